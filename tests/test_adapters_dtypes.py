"""The dtype matrix (issue 25): every diffusers adapter (SD3, FLUX.1, Qwen-Image, Wan2.1, Z-Image) in
float32 and bfloat16 on tiny random-config pipelines: it trains one iteration, samples, and its LoRA
export reloads in plain diffusers at the same dtype. Modules a pipeline keeps in float32 on purpose
(Wan's norms and time embedder, ``_keep_in_fp32_modules``) stay float32, and LoRA weights are float32.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from tiny_diffusers import BUILDERS, SIZE, WAN_FRAMES, train_config  # noqa: E402

from flowcredit.models.diffusers_common import LORA_WEIGHTS  # noqa: E402
from flowcredit.models.flux import FluxFlowModel  # noqa: E402
from flowcredit.models.qwen_image import QwenImageFlowModel  # noqa: E402
from flowcredit.models.sd3 import SD3FlowModel  # noqa: E402
from flowcredit.models.wan import WanFlowModel  # noqa: E402
from flowcredit.models.z_image import ZImageFlowModel  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
ADAPTERS = {"sd3": SD3FlowModel, "flux": FluxFlowModel, "qwen_image": QwenImageFlowModel}
ADAPTERS |= {"wan": WanFlowModel, "z_image": ZImageFlowModel}
KINDS = {kind: (ADAPTERS[kind], BUILDERS[kind]) for kind in ADAPTERS}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPTS = ["a red square", "a photo of a cat", "a big blue circle on the sign"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipes_dtypes")
    return {kind: build(root / kind) for kind, (_, build) in KINDS.items()}


def load(dirs, kind: str, dtype: str):
    extra = {"num_frames": WAN_FRAMES} if kind == "wan" else {}
    return KINDS[kind][0].from_pretrained(
        str(dirs[kind]), dtype=dtype, device="cpu", resolution=SIZE, **extra
    )


def sample(model, steps: int = 4) -> torch.Tensor:
    """An ODE sample from fixed noise with the adapter's own schedule (float32 latents)."""
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigmas, cond = model.sigmas(steps, None), model.encode(PROMPTS[:2])
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * model.velocity(x, sigmas[i].expand(2), cond)
    return x


def kept_in_fp32(model) -> list[str]:
    keep = getattr(model.net, "_keep_in_fp32_modules", None) or []
    return [n for n, _ in model.net.named_parameters() if any(k in n for k in keep)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_adapter_samples_in_each_dtype(dirs, kind, dtype):
    model = load(dirs, kind, dtype)
    assert model.dtype == DTYPES[dtype]
    params = dict(model.net.named_parameters())
    assert all(params[n].dtype == torch.float32 for n in kept_in_fp32(model))
    got = sample(model)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    if dtype != "float32":  # the same sample as float32, up to bf16 rounding
        want = sample(load(dirs, kind, "float32"))
        assert ((got - want).norm() / want.norm()).item() < 0.1


def test_wan_keeps_its_float32_modules_in_bf16(dirs):
    model = load(dirs, "wan", "bfloat16")
    kept = kept_in_fp32(model)
    assert kept, "WanTransformer3DModel names modules it keeps in float32"
    assert next(model.net.parameters()).dtype == torch.float32  # why the first parameter misleads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_adapter_trains_one_iteration_in_each_dtype(dirs, kind, dtype, tmp_path):
    from flowcredit.train import train

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config("tp_grpo", kind, dirs[kind], prompts, tmp_path / "run")
    cfg.dtype, cfg.threads = dtype, 1
    train(cfg)
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["iteration"] == 1 and "loss/policy" in last, last
    numbers = {k: v for k, v in last.items() if isinstance(v, float) and not k.endswith("/strict")}
    assert all(math.isfinite(v) for v in numbers.values()), last
    assert (tmp_path / "run" / "final" / LORA_WEIGHTS).is_file()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_lora_export_reloads_in_each_dtype(dirs, kind, dtype, tmp_path):
    model = load(dirs, kind, dtype)
    policy = Policy(model, "lora", 4, 8.0, "default")
    assert all(p.dtype == torch.float32 for p in policy.parameters())  # LoRA weights stay float32
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.net.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    x = torch.randn(2, *model.latent_shape, generator=g)
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v = model.velocity(x, sigma, model.encode(PROMPTS[:2]))
    model.save_final(policy, tmp_path)
    pipe = model.pipeline_class.from_pretrained(
        str(dirs[kind]), dtype={"default": DTYPES[dtype], "vae": torch.float32}
    )
    pipe.load_lora_weights(str(tmp_path), weight_name=LORA_WEIGHTS)
    extra = {"num_frames": WAN_FRAMES} if kind == "wan" else {}
    reloaded = KINDS[kind][0](pipe, resolution=SIZE, **extra)
    with torch.no_grad():
        got = reloaded.velocity(x, sigma, reloaded.encode(PROMPTS[:2]))
    tol = 1e-5 if dtype == "float32" else 0.05  # bf16: the reload merges nothing, the rounding differs
    assert ((got - v).norm() / v.norm()).item() < tol
