"""The Qwen-Image, Wan2.1 text-to-video and Z-Image adapters on tiny random-config pipelines (built
once per session, offline).

Checks: shapes (Wan: clips); sampling with our Euler step and the adapter's schedule reproduces the
diffusers pipeline (latents and decoded output); each model's CFG (Qwen-Image: with its norm rescale;
Z-Image: ``v_cond + w·(v_cond − v_neg)``); the
schedule equals ``set_timesteps`` (Wan: also a UniPC flow-sigma scheduler, as the hub checkpoints
ship); LoRA through ``Policy`` reloads in plain diffusers exactly; every preset trains one iteration.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from tiny_diffusers import (  # noqa: E402
    SIZE,
    WAN_FRAMES,
    build_qwen_image,
    build_wan,
    build_z_image,
    train_config,
)

from flowcredit.models.diffusers_common import LORA_WEIGHTS  # noqa: E402
from flowcredit.models.flux import pack, unpack  # noqa: E402
from flowcredit.models.protocol import FlowModel  # noqa: E402
from flowcredit.models.qwen_image import QwenImageFlowModel  # noqa: E402
from flowcredit.models.wan import WanFlowModel  # noqa: E402
from flowcredit.models.z_image import ZImageFlowModel  # noqa: E402
from flowcredit.presets import COMPARED_PRESETS  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
DEVICE = os.environ.get("FLOWCREDIT_TEST_DEVICE", "cpu")
ATOL = 1e-5 if DEVICE == "cpu" else 2e-3
KINDS = {
    "qwen_image": (QwenImageFlowModel, build_qwen_image),
    "wan": (WanFlowModel, build_wan),
    "z_image": (ZImageFlowModel, build_z_image),
}
LATENTS = {
    "qwen_image": (4, 8, 8),
    "wan": (4, 2, 4, 4),
    "z_image": (4, 16, 16),
}  # VAE /4, /8 (and time /4), /2
PROMPTS = ["a red square", "a photo of a cat", "a big blue circle on the sign"]


@pytest.fixture(scope="session")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipes_qwen_wan")
    return {kind: build(root / kind) for kind, (_, build) in KINDS.items()}


def load(dirs, kind, **kw):
    if kind == "wan":
        kw.setdefault("num_frames", WAN_FRAMES)
    cls = KINDS[kind][0]
    return cls.from_pretrained(str(dirs[kind]), dtype="float32", device=DEVICE, resolution=SIZE, **kw)


def inputs(model, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *model.latent_shape, generator=g), torch.rand(b, generator=g) * 0.9 + 0.05


def ode(model, x, sigmas, cond):
    """Our Euler ODE sampler: ``x ← x + (σ' − σ)·v``."""
    with torch.no_grad():
        for i in range(len(sigmas) - 1):
            x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i].expand(x.shape[0]), cond)
    return x


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_and_rows(dirs, kind):
    model = load(dirs, kind)
    assert isinstance(model, FlowModel)
    assert model.latent_shape == LATENTS[kind]
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    v = model.velocity(x, sigma, cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    idx = torch.tensor([2, 0])
    assert torch.allclose(model.velocity(x[idx], sigma[idx], cond[idx]), v[idx], atol=ATOL)
    out = model.decode(x[:2])
    shape = (2, WAN_FRAMES, 3, SIZE, SIZE) if kind == "wan" else (2, 3, SIZE, SIZE)
    assert out.shape == shape and out.dtype == torch.float32 and 0 <= out.min() and out.max() <= 1


def test_wan_frames_must_be_4k_plus_1(dirs):
    with pytest.raises(ValueError, match="num_frames.*4·k \\+ 1"):
        load(dirs, "wan", num_frames=6)
    assert load(dirs, "wan", num_frames=9).latent_shape == (4, 3, 4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_reproduces_the_diffusers_pipeline(dirs, kind):
    """Our Euler ODE on the adapter's velocity and schedule == the pipeline's own loop (timestep
    scaling, true CFG with the negative prompt, packing, schedule), and ``decode`` == its output."""
    model = load(dirs, kind)
    x0, _ = inputs(model, b=2)
    n = 3
    x = ode(model, x0, model.sigmas(n), model.encode(PROMPTS[:2]))
    kw = dict(num_inference_steps=n, height=SIZE, width=SIZE, max_sequence_length=16)
    if kind == "wan":
        kw |= dict(guidance_scale=model.guidance_scale, num_frames=WAN_FRAMES, latents=x0)
        run = lambda out: model.pipe(PROMPTS[:2], output_type=out, **kw).frames  # noqa: E731
        ref, decoded = run("latent").cpu(), run("pt").cpu()
    elif kind == "z_image":
        kw |= dict(guidance_scale=model.guidance_scale, latents=x0)
        run = lambda out: model.pipe(PROMPTS[:2], output_type=out, **kw).images  # noqa: E731
        ref, decoded = run("latent").cpu(), run("pt").cpu()
    else:
        kw |= dict(true_cfg_scale=model.guidance_scale, negative_prompt=" ", latents=pack(x0))
        run = lambda out: model.pipe(PROMPTS[:2], output_type=out, **kw).images  # noqa: E731
        ref, decoded = unpack(run("latent").cpu(), *model.latent_shape[1:]), run("pt").cpu()
    assert not torch.allclose(x, x0, atol=1e-2)
    assert torch.allclose(x, ref, atol=ATOL), (x - ref).abs().max()
    assert torch.allclose(model.decode(x), decoded, atol=ATOL)


def test_qwen_true_cfg_with_norm_rescale(dirs):
    model = load(dirs, "qwen_image")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    v = model.velocity(x, sigma, cond)
    model.guidance_scale = 1.0
    assert model.guidance_passes == 1
    v_cond, v_neg = model.velocity(x, sigma, cond), model.velocity(x, sigma, cond.null.expand(3))
    comb = pack(v_neg + 4.0 * (v_cond - v_neg))  # (B, T, 4C): the rescale is per packed token
    by_hand = unpack(comb * pack(v_cond).norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True), 8, 8)
    assert torch.allclose(v, by_hand, atol=1e-5)
    assert not torch.allclose(v, unpack(comb, 8, 8), atol=1e-3)  # the rescale matters


def test_wan_cfg_uses_the_negative_prompt(dirs):
    model = load(dirs, "wan", negative_prompt="blurry")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    v = model.velocity(x, sigma, cond)
    model.guidance_scale = 1.0
    v_cond, v_neg = model.velocity(x, sigma, cond), model.velocity(x, sigma, cond.null.expand(3))
    assert torch.allclose(v, v_neg + 5.0 * (v_cond - v_neg), atol=1e-5)
    empty = load(dirs, "wan")  # the pipeline's default negative prompt ""
    assert not torch.allclose(empty.encode(PROMPTS).null.embeds, cond.null.embeds)


def test_z_image_cfg_adds_w_to_one(dirs):
    model = load(dirs, "z_image")
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    assert model.guidance_passes == 2
    v = model.velocity(x, sigma, cond)
    model.guidance_scale = 0.0  # the pipeline's "no CFG"
    assert model.guidance_passes == 1
    v_cond, v_neg = model.velocity(x, sigma, cond), model.velocity(x, sigma, cond.null.expand(3))
    assert torch.allclose(v, v_cond + 5.0 * (v_cond - v_neg), atol=1e-5)
    assert not torch.allclose(v_cond, v_neg, atol=1e-4)


@pytest.mark.parametrize("n", [4, 20])
def test_schedules_match_set_timesteps(dirs, n):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    wan = load(dirs, "wan")
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(n)
    assert torch.equal(wan.sigmas(n), ref.sigmas)
    wan.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    unipc = UniPCMultistepScheduler.from_config(wan.scheduler.config)
    unipc.set_timesteps(n)
    assert torch.equal(wan.sigmas(n), unipc.sigmas.float())
    qwen = load(dirs, "qwen_image")
    sched = FlowMatchEulerDiscreteScheduler.from_config(qwen.scheduler.config)
    c = sched.config
    mu = calculate_shift(16, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    assert torch.equal(qwen.sigmas(n), sched.sigmas)
    for s in (wan.sigmas(n), qwen.sigmas(n)):
        assert s.dtype == torch.float32 and s.shape == (n + 1,)
        assert s[0] == pytest.approx(1.0, abs=1e-5) and s[-1] == 0.0 and (s[1:] < s[:-1]).all()
    assert qwen.sigmas(n)[-2] == pytest.approx(0.02)  # the checkpoint's terminal σ
    z = load(dirs, "z_image")
    ref = FlowMatchEulerDiscreteScheduler(shift=3.0)
    ref.set_timesteps(sigmas=torch.linspace(1.0, 1 / n, n).tolist())  # the pipeline's default sigmas
    assert torch.equal(z.sigmas(n), ref.sigmas)


def test_qwen_refuses_a_one_step_schedule(dirs):
    """Qwen-Image's terminal stretch divides by zero at one step (its diffusers pipeline samples NaN
    there): the adapter raises instead of handing the sampler a NaN σ (an ``eval_num_steps`` of 1 used to
    evaluate to NaN without a word); two steps are fine."""
    qwen = load(dirs, "qwen_image")
    with pytest.raises(ValueError, match="non-finite 1-step schedule.*shift_terminal=0.02.*at least 2"):
        qwen.sigmas(1)
    assert torch.isfinite(qwen.sigmas(2)).all()


@pytest.mark.parametrize("kind", KINDS)
def test_lora_trains_and_reloads_exactly_in_diffusers(dirs, kind, tmp_path):
    model = load(dirs, kind)
    x, sigma = inputs(model)
    cond = model.encode(PROMPTS)
    base = model.velocity(x, sigma, cond)
    policy = Policy(model, "lora", 4, 8.0, "default")
    suffixes = tuple(model.default_lora_targets.split(","))
    assert policy.lora_names and all(n.endswith(suffixes) for n in policy.lora_names)
    assert {next(t for t in suffixes if n.endswith(t)) for n in policy.lora_names} == set(suffixes)
    assert all("lora_" in n for n, p in model.net.named_parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    v = model.velocity(x, sigma, cond)
    assert not torch.allclose(v, base, atol=1e-4)
    with torch.no_grad(), policy.reference():
        assert torch.allclose(model.velocity(x, sigma, cond), base, atol=ATOL)
    v.mean().backward()
    no_grad = {n for n, p in model.net.named_parameters() if p.requires_grad and p.grad is None}
    last = len(model.net.transformer_blocks) - 1 if kind == "qwen_image" else -1
    # Qwen-Image's last block's text-stream output projection feeds nothing: no gradient, as expected
    assert no_grad == {n for n in no_grad if n.startswith(f"transformer_blocks.{last}.attn.to_add_out.")}
    assert len(no_grad) <= 2
    model.save_final(policy, tmp_path)
    pipe = model.pipeline_class.from_pretrained(str(dirs[kind]))
    pipe.load_lora_weights(str(tmp_path), weight_name=LORA_WEIGHTS)
    extra = {"num_frames": WAN_FRAMES} if kind == "wan" else {}
    reloaded = KINDS[kind][0](pipe, resolution=SIZE, **extra)
    with torch.no_grad():
        assert torch.allclose(reloaded.velocity(x, sigma, reloaded.encode(PROMPTS)), v, atol=ATOL)


@pytest.mark.parametrize("preset", COMPARED_PRESETS)
@pytest.mark.parametrize("kind", KINDS)
def test_train_every_method(dirs, kind, preset, tmp_path):
    from flowcredit.train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config(preset, kind, dirs[kind], prompts, tmp_path / "run")
    cfg.threads = 1
    train(cfg)
    run = tmp_path / "run"
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["iteration"] == 1 and "loss/policy" in last, last
    numbers = {k: v for k, v in last.items() if isinstance(v, float) and not k.endswith("/strict")}
    assert all(math.isfinite(v) for v in numbers.values()), last
    assert (run / "final" / LORA_WEIGHTS).is_file() and (run / "grid_after_test.png").is_file()


@pytest.mark.parametrize("kind", KINDS)
def test_max_sequence_length_sets_the_text_tokens(dirs, kind):
    """The config field through ``load_model``: Wan's UMT5 embeddings are padded (or cut) to ``n``;
    Qwen-Image's and Z-Image's LLM embeddings are cut to ``n`` (a longer limit leaves these short
    prompts as they are: neither keeps padding beyond the batch's longest prompt). The negative prompt
    is encoded with the same limit."""
    from flowcredit.config import Config
    from flowcredit.models import load_model

    def lengths(n: int) -> tuple[list[int], list[int]]:
        extra = {"num_frames": WAN_FRAMES} if kind == "wan" else {}
        cfg = Config(model=kind, checkpoint=str(dirs[kind]), resolution=SIZE, dtype="float32", **extra)
        cfg.max_sequence_length = n
        cond = load_model(cfg).encode(PROMPTS)
        rows = [len(e) for e in cond.embeds] if kind == "z_image" else [cond.embeds.shape[1]] * 3
        null = [len(e) for e in cond.null.embeds] if kind == "z_image" else [cond.null.embeds.shape[1]]
        return rows, null

    default = lengths(0)
    assert lengths(3) == ([3, 3, 3], [3])
    if kind == "wan":
        assert default == ([16, 16, 16], [16]) and lengths(40) == ([40, 40, 40], [40])
    else:
        assert max(default[0]) > 3 and lengths(40) == default


@pytest.mark.parametrize("kind", KINDS)
def test_cfg_uncond_grad_detaches_the_negative_branch(dirs, kind):
    """``cfg_uncond_grad`` false: the LoRA gradient equals the hand-built one whose negative-prompt
    velocity is a constant (each model's own CFG: Wan ``v_neg + w·(v_cond − v_neg)``, Z-Image
    ``v_cond + w·(v_cond − v_neg)``, Qwen-Image with its norm rescale); true: it differs. The
    velocity itself is the same either way (without gradient both run CFG's one joint pass)."""
    model = load(dirs, kind)
    policy = Policy(model, "lora", 4, 8.0, "default")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    x, sigma = inputs(model)
    cond, weights, w = model.encode(PROMPTS), torch.randn(x.shape, generator=g), model.guidance_scale

    def lora_grads(velocity) -> list[torch.Tensor]:
        for p in policy.parameters():
            p.grad = None
        (velocity() * weights).sum().backward()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in policy.parameters()]

    def by_hand() -> torch.Tensor:
        model.guidance_scale = 0.0 if kind == "z_image" else 1.0  # one conditional pass
        v_cond = model.velocity(x, sigma, cond)
        with torch.no_grad():
            v_neg = model.velocity(x, sigma, cond.null.expand(3))
        model.guidance_scale = w
        if kind == "z_image":
            return v_cond + w * (v_cond - v_neg)
        v = v_neg + w * (v_cond - v_neg)
        if kind == "wan":
            return v
        comb, norm = pack(v), pack(v_cond).norm(dim=-1, keepdim=True)
        return unpack(comb * norm / comb.norm(dim=-1, keepdim=True), *model.latent_shape[1:])

    grads, values = {}, {}
    for through_uncond in (True, False):
        model.cfg_uncond_grad = through_uncond
        grads[through_uncond] = lora_grads(lambda: model.velocity(x, sigma, cond))
        with torch.no_grad():
            values[through_uncond] = model.velocity(x, sigma, cond)
    assert torch.equal(values[True], values[False])
    want = lora_grads(by_hand)
    for a, b in zip(grads[False], want):  # float rounding apart (the order of Qwen's rescale differs)
        assert (a - b).abs().max() <= 1e-4 * a.abs().max() + 1e-8
    assert max((a - b).abs().max().item() for a, b in zip(grads[True], grads[False])) > 1e-4
