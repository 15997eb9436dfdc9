"""The SD3 and FLUX.1 diffusers adapters on tiny random-config pipelines (built and saved offline).

Checks: shapes and dtypes; sampling with our Euler step and the adapter's schedule reproduces the
diffusers pipeline (latents and images); CFG; the schedule equals ``set_timesteps``; FLUX packing;
LoRA through ``flowcredit.run.policy.Policy`` (only LoRA trains, the reference pass is the base model);
the exported LoRA reloads in plain diffusers; one training iteration of every preset per adapter.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from tiny_diffusers import SIZE, build_flux, build_sd3, train_config  # noqa: E402

from flowcredit.config import Config  # noqa: E402
from flowcredit.models.diffusers_common import LORA_WEIGHTS, PromptCond  # noqa: E402
from flowcredit.models.flux import FluxFlowModel, image_ids, pack, unpack  # noqa: E402
from flowcredit.models.protocol import FlowModel  # noqa: E402
from flowcredit.models.sd3 import SD3FlowModel  # noqa: E402
from flowcredit.presets import COMPARED_PRESETS  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402
from flowcredit.run.session import configure_network  # noqa: E402

pytestmark = pytest.mark.slow
torch.set_num_threads(2)
DEVICE = os.environ.get("FLOWCREDIT_TEST_DEVICE", "cpu")  # "cuda": the same checks on a GPU
ATOL = 1e-5 if DEVICE == "cpu" else 2e-3  # cuDNN convolutions use TF32 by default
KINDS = {"sd3": (SD3FlowModel, build_sd3), "flux": (FluxFlowModel, build_flux)}
PROMPTS = ["a red square", "a photo of a cat", "a big blue circle on the sign"]


def build_pipelines(root):
    """Each tiny pipeline built and saved under ``root/<kind>``: ``{kind: its folder}``."""
    return {kind: build(root / kind) for kind, (_, build) in KINDS.items()}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build_pipelines(tmp_path_factory.mktemp("pipes"))


def load(dirs, kind, **kw):
    return KINDS[kind][0].from_pretrained(
        str(dirs[kind]),
        dtype=kw.pop("dtype", "float32"),
        device=DEVICE,
        resolution=kw.pop("resolution", SIZE),
        **kw,
    )


def inputs(model, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *model.latent_shape, generator=g), torch.rand(b, generator=g) * 0.9 + 0.05


def ode(model, x, sigmas, cond):
    """Our Euler ODE sampler (docs/algorithms.md §1.1 ``ode``): ``x ← x + (σ' − σ)·v``."""
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i].expand(x.shape[0]), cond)
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_dtypes_and_rows(dirs, kind):
    model = load(dirs, kind)
    assert isinstance(model, FlowModel) and model.latent_shape == (4, SIZE // 2, SIZE // 2)
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    assert model.encode(list(PROMPTS)) is cond  # repeated prompt lists are not re-encoded
    v = model.velocity(x, sigma, cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    idx = torch.tensor([2, 0])
    assert torch.allclose(model.velocity(x[idx], sigma[idx], cond[idx]), v[idx], atol=ATOL)
    img = model.decode(x)
    assert img.shape == (3, 3, SIZE, SIZE) and img.dtype == torch.float32
    assert img.min() >= 0 and img.max() <= 1
    assert not any(p.requires_grad for p in model.pipe.text_encoder.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_weights_fp32_interface(dirs, kind):
    ref, model = load(dirs, kind), load(dirs, kind, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.vae.dtype == torch.float32
    x, sigma = inputs(model)
    v = model.velocity(x, sigma, model.encode(PROMPTS))
    v_ref = ref.velocity(x, sigma, ref.encode(PROMPTS))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert (v - v_ref).norm() / v_ref.norm() < 0.1
    assert model.decode(x).dtype == torch.float32


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_reproduces_the_diffusers_pipeline(dirs, kind):
    """Our Euler ODE on the adapter's velocity and schedule == the pipeline's own loop (sign, timestep
    scaling, CFG / guidance, packing, schedule), and ``decode`` == its image output."""
    model = load(dirs, kind)
    x0, _ = inputs(model, b=2)
    n = 4
    x = ode(model, x0, model.sigmas(n), model.encode(PROMPTS[:2]))
    kw = dict(
        num_inference_steps=n,
        guidance_scale=model.guidance_scale,
        height=SIZE,
        width=SIZE,
        max_sequence_length=16,
    )
    lat = x0 if kind == "sd3" else pack(x0)
    ref = model.pipe(PROMPTS[:2], latents=lat, output_type="latent", **kw).images.cpu()
    ref = ref if kind == "sd3" else unpack(ref, *model.latent_shape[1:])
    assert torch.allclose(x, ref, atol=ATOL), (x - ref).abs().max()
    img = model.pipe(PROMPTS[:2], latents=lat, output_type="pt", **kw).images.cpu()
    assert torch.allclose(model.decode(x), img, atol=ATOL)


def test_sd3_cfg_combination(dirs):
    model = load(dirs, "sd3")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    v = model.velocity(x, sigma, cond)
    model.guidance_scale = 1.0  # single conditional pass
    v_cond = model.velocity(x, sigma, cond)
    v_null = model.velocity(x, sigma, cond.null.expand(3))
    assert model.guidance_passes == 1
    model.guidance_scale = 4.5
    assert model.guidance_passes == 2
    assert torch.allclose(v, v_null + 4.5 * (v_cond - v_null), atol=ATOL)
    assert not torch.allclose(v_cond, v_null, atol=1e-4)


def test_flux_guidance_is_an_input_not_cfg(dirs):
    model = load(dirs, "flux")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    assert cond.null is None and model.guidance_passes == 1
    v = model.velocity(x, sigma, cond)
    model.guidance_scale = 1.0
    assert not torch.allclose(model.velocity(x, sigma, cond), v, atol=1e-5)


def test_flux_packing_matches_diffusers():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 6, 8)
    packed = FluxPipeline._pack_latents(x, 2, 4, 6, 8)
    assert torch.equal(pack(x), packed)
    assert torch.equal(unpack(packed, 6, 8), x)
    assert torch.equal(unpack(packed, 6, 8), FluxPipeline._unpack_latents(packed, 6 * 8, 8 * 8, 8))
    assert torch.equal(image_ids(6, 8), FluxPipeline._prepare_latent_image_ids(1, 3, 4, "cpu", torch.float32))


@pytest.mark.parametrize("n", [4, 10, 40])
def test_schedules_match_set_timesteps(dirs, n):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sd3 = load(dirs, "sd3")
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(n)
    assert torch.equal(sd3.sigmas(n), ref.sigmas)
    flux = load(dirs, "flux")
    sched = flux.scheduler
    tokens = (SIZE // 4) ** 2
    mu = calculate_shift(
        tokens,
        sched.config.base_image_seq_len,
        sched.config.max_image_seq_len,
        sched.config.base_shift,
        sched.config.max_shift,
    )
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    assert torch.equal(flux.sigmas(n), sched.sigmas)
    for s in (sd3.sigmas(n), flux.sigmas(n)):
        assert s.dtype == torch.float32 and s.shape == (n + 1,)
        assert s[0] == 1.0 and s[-1] == 0.0 and (s[1:] < s[:-1]).all()
    assert not torch.equal(load(dirs, "flux", resolution=2 * SIZE).sigmas(n), flux.sigmas(n))  # μ(resolution)


def _perturb_lora(net, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("kind", KINDS)
def test_policy_lora_and_reference(dirs, kind, tmp_path):
    model = load(dirs, kind)
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    base = model.velocity(x, sigma, cond)
    policy = Policy(model, "lora", 4, 8.0, "default")
    trainable = [n for n, p in model.net.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    suffixes = ("to_q", "to_k", "to_v", "to_out.0")
    assert all(n.endswith(suffixes) for n in policy.lora_names)
    assert {next(t for t in suffixes if n.endswith(t)) for n in policy.lora_names} == set(suffixes)
    assert len(policy.parameters()) == len(trainable) == len(model.trainable_parameters())
    for module in (model.vae, model.pipe.text_encoder, model.pipe.text_encoder_2):
        assert not any(p.requires_grad for p in module.parameters())
    assert torch.allclose(model.velocity(x, sigma, cond), base, atol=ATOL)  # lora_B = 0 at init
    _perturb_lora(model.net)
    v = model.velocity(x, sigma, cond)
    assert not torch.allclose(v, base, atol=1e-4)
    with torch.no_grad(), policy.reference():
        assert torch.allclose(model.velocity(x, sigma, cond), base, atol=ATOL)
    v.mean().backward()
    assert all(p.grad is not None for p in policy.parameters())

    # the exported LoRA reloads in plain diffusers (alpha/rank = 2 must survive) and matches
    model.save_final(policy, tmp_path)
    pipe = model.pipeline_class.from_pretrained(str(dirs[kind]))
    pipe.load_lora_weights(str(tmp_path), weight_name=LORA_WEIGHTS)
    reloaded = KINDS[kind][0](pipe, resolution=SIZE)
    with torch.no_grad():
        assert torch.allclose(reloaded.velocity(x, sigma, reloaded.encode(PROMPTS)), v, atol=ATOL)


def test_full_finetune_reference_and_export(dirs, tmp_path):
    """``train_params='all'``: the reference is a frozen copy swapped in as ``model.net``; export is
    ``transformer/`` in diffusers' format."""
    from diffusers import SD3Transformer2DModel

    model = load(dirs, "sd3")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    base = model.velocity(x, sigma, cond)
    policy = Policy(model, "all", need_reference=True)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    v = model.velocity(x, sigma, cond)
    assert not torch.allclose(v, base, atol=1e-4)
    with torch.no_grad(), policy.reference():
        assert torch.allclose(model.velocity(x, sigma, cond), base, atol=ATOL)
    model.save_final(policy, tmp_path)
    model.net = SD3Transformer2DModel.from_pretrained(str(tmp_path / "transformer"))
    assert torch.allclose(model.velocity(x, sigma, cond), v, atol=ATOL)


def test_lora_params_are_float32_on_a_bf16_model(dirs):
    model = load(dirs, "sd3", dtype="bfloat16")
    policy = Policy(model, "lora", 4, 8.0, "default")
    assert all(p.dtype == torch.float32 for p in policy.parameters())
    x, sigma = inputs(model)
    model.velocity(x, sigma, model.encode(PROMPTS)).mean().backward()
    assert all(p.grad.dtype == torch.float32 for p in policy.parameters())


def test_prompt_cond_selection():
    c = PromptCond(
        torch.arange(24.0).view(4, 3, 2),
        torch.arange(8.0).view(4, 2),
        PromptCond(torch.zeros(1, 3, 2), torch.zeros(1, 2)),
    )
    sel = c[torch.tensor([3, 3, 1])]
    assert len(sel) == 3 and torch.equal(sel.pooled[:, 0], torch.tensor([6.0, 6.0, 2.0]))
    assert sel.null is c.null and len(c[1]) == 1


# --- the trainer end to end (needs the trainer to accept model='sd3' / 'flux') ---


@pytest.mark.parametrize("preset", COMPARED_PRESETS)
@pytest.mark.parametrize("kind", KINDS)
def test_train_every_method(dirs, kind, preset, tmp_path):
    from safetensors.torch import load_file

    from flowcredit.train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config(preset, kind, dirs[kind], prompts, tmp_path / "run")
    train(cfg)
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last["iteration"] == 1 and "loss/policy" in last, last
    numbers = {k: v for k, v in last.items() if isinstance(v, float) and not k.endswith("/strict")}
    assert all(math.isfinite(v) for v in numbers.values()), last  # "strict" is NaN for non-ShapeEval rewards
    fresh = load(dirs, kind)
    init = {
        k: v.cpu()
        for k, v in Policy(fresh, "lora", 4, 8.0, "default", seed=cfg.seed).trainable_state().items()
    }
    final = load_file(str(run / "final" / "trainable.safetensors"))
    assert set(final) == set(init)
    assert any(not torch.equal(final[k], init[k]) for k in init), "no LoRA weight moved"
    assert (run / "final" / LORA_WEIGHTS).is_file()


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_uses_the_adapter_schedule(dirs, kind, tmp_path):
    from flowcredit.run.session import build_session

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config("flow_grpo", kind, dirs[kind], prompts, tmp_path / "run")
    s = build_session(cfg, resume=False)
    assert torch.equal(s.sigmas, s.model.sigmas(cfg.num_steps))


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_checkpointing_and_fsdp_blocks(dirs, kind):
    """Gradient checkpointing recomputes the same LoRA gradients; accelerate's FSDP2 wrap policy,
    given the adapter's ``fsdp_block_classes``, picks exactly the transformer blocks (FSDP itself
    does not run on CPUs under accelerate: docs/gpu.md, "Several GPUs")."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    grads = []
    for on in (False, True):
        model = load(dirs, kind)
        policy = Policy(model, "lora", 4, 8.0, "default")
        _perturb_lora(model.net)
        configure_network(Config(gradient_checkpointing=on), model)
        x, sigma = inputs(model)
        model.velocity(x, sigma, model.encode(PROMPTS)).square().mean().backward()
        grads.append([p.grad for p in policy.parameters()])
    assert model.net.gradient_checkpointing
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    blocks = {
        "sd3": ("JointTransformerBlock",),
        "flux": ("FluxTransformerBlock", "FluxSingleTransformerBlock"),
    }
    assert model.fsdp_block_classes == blocks[kind]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=list(model.fsdp_block_classes),
    )
    shard_unit = fsdp2_prepare_auto_wrap_policy(plugin, model.net)
    units = [name for name, m in model.net.named_modules() if shard_unit(m)]
    assert units and units == [n for n, m in model.net.named_modules() if type(m).__name__ in blocks[kind]]
