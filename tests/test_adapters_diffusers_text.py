"""The Flow-GRPO fields on the SD3 and FLUX.1 adapters (tiny random-config pipelines, built offline):
the text length (``max_sequence_length``: T5's tokens, errors, recorded in the run and its export) and
the CFG gradient (``cfg_uncond_grad``: SD3's null branch detached as Flow-GRPO's ``compute_log_prob``).
Fixtures and helpers: ``test_adapters_diffusers.py``."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from test_adapters_diffusers import (  # noqa: E402
    ATOL,
    DEVICE,
    KINDS,
    PROMPTS,
    _perturb_lora,
    build_pipelines,
    inputs,
    load,
    ode,
)
from tiny_diffusers import SIZE, train_config  # noqa: E402

from flowcredit.config import Config  # noqa: E402
from flowcredit.models.flux import pack, unpack  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build_pipelines(tmp_path_factory.mktemp("pipes"))


@pytest.mark.parametrize("kind", KINDS)
def test_max_sequence_length_sets_the_t5_tokens(dirs, kind):
    """The config field is T5's length: SD3's embeddings are the CLIP tokens (the tiny tokenizer's 16)
    then ``n`` T5 tokens, the empty prompt's too; FLUX's are ``n`` T5 tokens. The padding is attended,
    so the velocity changes with ``n`` even for these short prompts; the policy equals the pipeline's
    ``pipe(prompt, max_sequence_length=n)``, the keyword the export records. 0: the default (the
    tiny tokenizer's 16, the pipelines' 256 / 512 clipped to it)."""
    from flowcredit.models import load_model

    clip = 16 if kind == "sd3" else 0
    base = dict(model=kind, checkpoint=str(dirs[kind]), resolution=SIZE, dtype="float32")
    x, sigma = inputs(load(dirs, kind))
    velocities = {}
    for n in (0, 8, 40):
        model = load_model(Config(**base, max_sequence_length=n)).to(DEVICE)
        assert model.max_sequence_length == (n or 16) and model.default_max_sequence_length() == 16
        cond = model.encode(PROMPTS)
        assert cond.embeds.shape[:2] == (3, clip + (n or 16))
        if kind == "sd3":
            assert cond.null.embeds.shape[:2] == (1, clip + (n or 16))
        with torch.no_grad():
            velocities[n] = model.velocity(x, sigma, cond)
    assert (velocities[8] - velocities[0]).abs().max() > 1e-4
    assert (velocities[40] - velocities[0]).abs().max() > 1e-4

    x0, _ = inputs(model, b=2)
    ours = ode(model, x0, model.sigmas(2), model.encode(PROMPTS[:2]))
    kw = dict(num_inference_steps=2, guidance_scale=model.guidance_scale, height=SIZE, width=SIZE)
    lat = x0 if kind == "sd3" else pack(x0)
    ref = model.pipe(PROMPTS[:2], latents=lat, output_type="latent", max_sequence_length=40, **kw).images
    ref = ref.cpu() if kind == "sd3" else unpack(ref.cpu(), *model.latent_shape[1:])
    assert torch.allclose(ours, ref, atol=ATOL), (ours - ref).abs().max()


def test_max_sequence_length_errors(dirs, tmp_path):
    """Above the pipeline's bound (SD3: 512), and a length set from Python on a model given to
    ``build_session`` that the config does not name (it would not be in config.json), are refused."""
    from flowcredit.errors import ConfigError
    from flowcredit.run.session import build_session
    from flowcredit.validation import validate

    with pytest.raises(ConfigError, match="max_sequence_length.*513 tokens.*at most 512"):
        load(dirs, "sd3", max_sequence_length=513)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config("flow_grpo", "sd3", dirs["sd3"], prompts, tmp_path / "run")
    with pytest.raises(ConfigError, match="max_sequence_length.*encodes 8 tokens"):
        build_session(cfg, model=load(dirs, "sd3", max_sequence_length=8))
    assert not (tmp_path / "run" / "config.json").exists()
    cfg.max_sequence_length = 8
    s = build_session(validate(cfg), model=load(dirs, "sd3", max_sequence_length=8))
    assert s.model.max_sequence_length == 8


def test_max_sequence_length_reaches_the_run_and_its_export(dirs, tmp_path):
    """A run with ``max_sequence_length`` (and Flow-GRPO's ``cfg_uncond_grad: false``) records it in
    config.json and in ``final/flowcredit_export.json`` (the keyword of a plain ``pipe(…)``), and
    ``flowcredit eval/sample`` rebuild the model from config.json with the same text length."""
    from flowcredit.config import from_dict
    from flowcredit.models import load_model
    from flowcredit.train import train
    from flowcredit.validation import validate

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = train_config("flow_grpo", "sd3", dirs["sd3"], prompts, tmp_path / "run")
    cfg.max_sequence_length, cfg.cfg_uncond_grad = 8, False
    train(validate(cfg))
    run = tmp_path / "run"
    saved = json.loads((run / "config.json").read_text())
    assert saved["max_sequence_length"] == 8 and saved["cfg_uncond_grad"] is False
    info = json.loads((run / "final" / "flowcredit_export.json").read_text())
    assert info == {"pipeline": "StableDiffusion3Pipeline", "max_sequence_length": 8}
    assert load_model(from_dict(saved)).max_sequence_length == 8


def test_cfg_uncond_grad_detaches_sd3s_null_branch(dirs):
    """``cfg_uncond_grad`` false: SD3's LoRA gradient equals the hand-built one with the empty prompt's
    branch detached (Flow-GRPO's ``compute_log_prob``), and differs from the default's (both)."""
    model = load(dirs, "sd3")
    policy = Policy(model, "lora", 4, 8.0, "default")
    _perturb_lora(model.net)
    x, sigma = inputs(model)
    cond, weights = model.encode(PROMPTS), torch.randn_like(x)

    def by_hand(detach_null: bool) -> torch.Tensor:
        null = cond.null.expand(3)
        if detach_null:  # Flow-GRPO's gradient; the null rows as their own pass, without a graph
            with torch.no_grad():
                v_null = model.predict(x, sigma, null.embeds, null.pooled)
            return v_null + model.guidance_scale * (
                model.predict(x, sigma, cond.embeds, cond.pooled) - v_null
            )
        v_null, v_cond = model.predict(
            torch.cat([x, x]),
            torch.cat([sigma, sigma]),
            torch.cat([null.embeds, cond.embeds]),
            torch.cat([null.pooled, cond.pooled]),
        ).chunk(2)
        return v_null + model.guidance_scale * (v_cond - v_null)

    def lora_grads(velocity) -> list[torch.Tensor]:
        for p in policy.parameters():
            p.grad = None
        (velocity() * weights).sum().backward()
        return [p.grad.clone() for p in policy.parameters()]

    grads = {}
    for through_uncond in (True, False):
        model.cfg_uncond_grad = through_uncond
        grads[through_uncond] = lora_grads(lambda: model.velocity(x, sigma, cond))
        want = lora_grads(lambda detach=not through_uncond: by_hand(detach))
        for a, b in zip(grads[through_uncond], want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert max((a - b).abs().max().item() for a, b in zip(grads[True], grads[False])) > 1e-4
