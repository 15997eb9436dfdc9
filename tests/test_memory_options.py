"""The memory plan's options (issue 57; flowcredit/models/memory_options.py) leave the numbers as they were
(or within a stated tolerance), on the tiny SD3 and FLUX.1 pipelines.

- ``text_encoders`` 'offload' / 'cpu': the same encodings (a prompt encoded in another batch may differ
  in the last bits: tolerance 1e-6 in float32), the encoders moved to the device only for prompts not yet
  cached, and one training iteration with the same rewards, advantages, loss and gradient norm (relative
  1e-5) as 'device'; so do ``decode_chunk`` 1 and ``batch_size`` 2.
- ``decode_chunk``: images of chunk 1 = chunk 8 within 1e-5 (convolutions' batch-size rounding).
- The reference policy is LoRA switched off, no copy; the optimizer holds LoRA state only.
- ``base_quantization`` float8 / int8 (torchao): 8-bit block weights, velocities within 5 % (RMS) of the
  unquantised model, LoRA trains on top of them (the merged policy runs those layers unmerged).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from tiny_diffusers import SIZE, build_flux, build_sd3, train_config  # noqa: E402

from flowcredit.errors import ConfigError  # noqa: E402
from flowcredit.models import memory_options  # noqa: E402
from flowcredit.models.diffusers_common import PromptCond  # noqa: E402
from flowcredit.models.flux import FluxFlowModel  # noqa: E402
from flowcredit.models.memory_options import EncodingCache, tensor_bytes  # noqa: E402
from flowcredit.models.sd3 import SD3FlowModel  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402

pytestmark = pytest.mark.slow
KINDS = {"sd3": (SD3FlowModel, build_sd3), "flux": (FluxFlowModel, build_flux)}
PROMPTS = ["a red square", "a photo of a cat", "a big blue circle on the sign"]
ENCODING_TOL = 1e-6


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipes")
    return {kind: build(root / kind) for kind, (_, build) in KINDS.items()}


def load(dirs, kind, **kw):
    dtype = kw.pop("dtype", "float32")
    return KINDS[kind][0].from_pretrained(str(dirs[kind]), dtype=dtype, device="cpu", resolution=SIZE, **kw)


def close(a, b, tol):
    return a.shape == b.shape and bool((a - b).abs().max() <= tol)


# --- the per-prompt cache on its own ---


def rows_cond(prompts):
    """A PromptCond whose row of prompt p holds len(p), and a null of -1."""
    lengths = torch.tensor([float(len(p)) for p in prompts])
    null = PromptCond(torch.full((1, 2, 3), -1.0), torch.full((1, 4), -1.0))
    embeds = lengths.view(-1, 1, 1).expand(-1, 2, 3).clone()
    return PromptCond(embeds, lengths.view(-1, 1).expand(-1, 4), null)


def test_cache_encodes_only_the_missing_prompts_and_keeps_order():
    calls = []
    cache = EncodingCache()

    def encode(prompts):
        calls.append(list(prompts))
        return rows_cond(prompts)

    first = cache.encode(["ab", "c", "ab"], encode)
    assert calls == [["ab", "c"]]  # each prompt once
    assert first.embeds[:, 0, 0].tolist() == [2.0, 1.0, 2.0] and first.null.embeds.eq(-1).all()
    second = cache.encode(["dddd", "c"], encode)
    assert calls[-1] == ["dddd"] and second.embeds[:, 0, 0].tolist() == [4.0, 1.0]
    cache.encode(["c", "ab"], encode)
    assert len(calls) == 2  # nothing new


def test_cache_drops_the_least_recently_used_past_its_bytes():
    one = tensor_bytes(rows_cond(["x"]).rows(0))  # 6 + 4 floats = 40 bytes
    cache = EncodingCache(max_bytes=2 * one)
    cache.encode(["a", "b"], rows_cond)
    cache.encode(["a"], rows_cond)  # "a" used last: "b" goes first
    cache.encode(["c"], rows_cond)
    assert list(cache.entries) == ["a", "c"] and cache.bytes == 2 * one


def test_cache_keeps_unsplittable_encodings_per_list():
    @dataclasses.dataclass
    class Whole:  # no rows / cat_rows: Qwen-Image's and Z-Image's encodings
        embeds: torch.Tensor

    calls = []

    def encode(prompts):
        calls.append(list(prompts))
        return Whole(torch.arange(len(prompts), dtype=torch.float32))

    cache = EncodingCache()
    assert cache.encode(["a", "b"], encode).embeds.tolist() == [0.0, 1.0]
    cache.encode(["a", "b"], encode)
    cache.encode(["b", "a"], encode)  # another list: encoded whole
    assert calls == [["a", "b"], ["b", "a"]]


# --- the adapters ---


@pytest.mark.parametrize("placement", ["offload", "cpu"])
@pytest.mark.parametrize("kind", KINDS)
def test_text_placement_gives_the_same_encodings(dirs, kind, placement, monkeypatch):
    ref = load(dirs, kind).encode(PROMPTS)
    model = load(dirs, kind, text_encoders=placement)
    assert model.text_device == torch.device("cpu")  # the host here; the transformer's device for offload
    moves = []
    real = memory_options.modules_on

    def counting(modules, device, home):
        moves.append(len(modules))
        return real(modules, device, home)

    monkeypatch.setattr("flowcredit.models.diffusers_common.modules_on", counting)
    cond = model.encode(PROMPTS)
    assert close(cond.embeds, ref.embeds, ENCODING_TOL) and close(cond.pooled, ref.pooled, ENCODING_TOL)
    if ref.null is not None:
        assert close(cond.null.embeds, ref.null.embeds, ENCODING_TOL)
    again = model.encode([PROMPTS[2], PROMPTS[0]])  # cached: no encoder runs, no move
    assert close(again.embeds, ref.embeds[[2, 0]], ENCODING_TOL)
    n_encoders = len(memory_options.text_encoder_modules(model.pipe))
    assert n_encoders >= 2 and moves == ([n_encoders] if placement == "offload" else [])


def run_once(dirs, kind, tmp_path, name, **fields):
    from safetensors.torch import load_file

    from flowcredit.train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config("flow_grpo", kind, dirs[kind], prompts, tmp_path / name)
    train(dataclasses.replace(cfg, eval_every=1, **fields))
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(tmp_path / name / "final" / "trainable.safetensors")), rows[-1]


@pytest.mark.parametrize("kind", KINDS)
def test_training_with_the_plan_options_keeps_the_numbers(dirs, kind, tmp_path):
    base, base_row = run_once(dirs, kind, tmp_path, "device")
    for name, fields in {
        "offload": dict(text_encoders="offload"),
        "cpu": dict(text_encoders="cpu"),
        "chunk1": dict(decode_chunk=1),
        "batch2": dict(batch_size=2),  # rows per model call: the group of 2 × 2 by accumulation
    }.items():
        weights, row = run_once(dirs, kind, tmp_path, name, **fields)
        assert set(weights) == set(base)
        # the iteration's quantities, continuous in the inputs; not the weights after Adam's first step,
        # whose sign of a near-zero gradient component may flip with the last bit (a step of ±lr)
        for key in ("reward/mean", "eval/test/soft", "adv/abs_mean", "stats/grad_norm", "loss/policy"):
            assert abs(row[key] - base_row[key]) <= 1e-5 * max(1.0, abs(base_row[key])), (name, key)
        assert (
            json.loads((tmp_path / name / "config.json").read_text())[next(iter(fields))]
            == fields[next(iter(fields))]
        )


@pytest.mark.parametrize("kind", KINDS)
def test_decode_chunk_gives_the_same_images(dirs, kind):
    model = load(dirs, kind)
    x = torch.randn(5, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    whole = model.decode(x)
    model.decode_chunk = 1
    assert close(model.decode(x), whole, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_is_the_switched_off_lora_and_the_optimizer_holds_lora_only(dirs, kind):
    model = load(dirs, kind)
    storages = {p.untyped_storage().data_ptr() for p in model.net.parameters()}
    policy = Policy(model, "lora", 4, 8.0, "default", need_reference=True)
    assert policy.frozen_net is None  # no copy of the network
    base_ptrs = {p.untyped_storage().data_ptr() for n, p in model.net.named_parameters() if "lora_" not in n}
    assert base_ptrs <= storages  # the base weights were neither copied nor moved
    params = policy.parameters()
    assert all("lora_" in n for n, p in model.net.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state_numel = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    assert state_numel == 2 * sum(p.numel() for p in params)  # exp_avg and exp_avg_sq of LoRA only


@pytest.mark.parametrize("kind", ["float8", "int8"])
def test_quantised_base_stays_close_and_lora_trains_on_it(dirs, kind, tmp_path):
    pytest.importorskip("torchao", reason="needs the 'quant' extra: pip install -e '.[test]'")
    model = load(dirs, "sd3", dtype="bfloat16")
    quantised = load(dirs, "sd3", dtype="bfloat16", base_quantization=kind)
    layers = [m for m in quantised.net.modules() if isinstance(m, torch.nn.Linear)]
    packed = [m for m in layers if type(m.weight) is not torch.nn.Parameter]
    assert packed and all(m.weight.__tensor_flatten__()[0] for m in packed)
    assert memory_options.quantize_base(quantised.net, kind) == 0  # idempotent
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.7, 0.3]), model.encode(PROMPTS[:2])
    with torch.no_grad():
        v, vq = model.velocity(x, sigma, cond), quantised.velocity(x, sigma, quantised.encode(PROMPTS[:2]))
    assert float((vq - v).square().mean().sqrt() / v.square().mean().sqrt()) < 0.05
    weights, row = run_once(dirs, "sd3", tmp_path, kind, dtype="bfloat16", base_quantization=kind)
    assert all(torch.isfinite(w).all() for w in weights.values()) and row["iteration"] == 1


@pytest.mark.parametrize(
    "fields, culprit",
    [
        (dict(text_encoders="gpu"), "text_encoders"),
        (dict(base_quantization="fp4"), "base_quantization"),
        (dict(decode_chunk=-1), "decode_chunk"),
    ],
)
def test_a_bad_option_names_its_field(dirs, fields, culprit):
    from flowcredit.config import Config

    cfg = dataclasses.replace(Config(), **fields)
    with pytest.raises(ConfigError, match=culprit):
        memory_options.check_memory_options(cfg, load(dirs, "sd3"))


def test_the_tiny_model_refuses_text_placement():
    from flowcredit.config import Config
    from flowcredit.models import load_model

    with pytest.raises(ConfigError, match="text_encoders.*no separate text encoders"):
        load_model(dataclasses.replace(Config(), text_encoders="offload"))


# --- the reward on the GPU only while it scores (the ``offload`` reward option) ---


def toy_network_reward(*, scale: float = 1.0):
    net = torch.nn.Linear(3, 1)
    torch.nn.init.constant_(net.weight, scale)
    torch.nn.init.zeros_(net.bias)

    def fn(images, prompts, metadata):
        return net(images.mean(dim=(2, 3))).squeeze(-1)

    fn.modules = [net]
    return fn


def test_reward_offload_moves_the_network_only_while_scoring(monkeypatch):
    from flowcredit.rewards import REWARDS, build_reward

    monkeypatch.setitem(REWARDS, "toynet", toy_network_reward)
    moves = []
    real = memory_options.modules_on

    def counting(modules, device, home):
        moves.append((len(modules), str(device), home))
        return real(modules, device, home)

    monkeypatch.setattr(memory_options, "modules_on", counting)
    images = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    plain = build_reward("toynet", {"scale": 2.0})(images, [""] * 4, [{}] * 4)
    offloaded = build_reward("toynet", {"scale": 2.0, "offload": True})
    assert moves == []
    assert torch.equal(offloaded(images, [""] * 4, [{}] * 4), plain)
    assert moves == [(1, "cpu", "cpu")] and offloaded.modules[0].weight.device.type == "cpu"


def test_reward_offload_needs_a_network_and_a_bool(monkeypatch):
    from flowcredit.errors import UserError
    from flowcredit.rewards import build_reward

    with pytest.raises(UserError, match="'jpeg_compressibility'.*offload.*networks of its own"):
        build_reward("jpeg_compressibility", {"offload": True})
    with pytest.raises(UserError, match="offload.*true or false"):
        build_reward("jpeg_compressibility", {"offload": "yes"})
