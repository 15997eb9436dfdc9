"""``--guidance_scale 1`` (CFG off) reaches the adapter as 1, not as the model's default (issue 54).

``guidance_scale`` 0 is the config's "keep the model's default"; every other value, 1 included, is
the run's. Flow-GRPO's CFG-free settings and DiffusionNFT's rollouts (guidance 1) depend on it: a 1
replaced by the default would sample with CFG at twice the network calls, and nothing else would fail.
"""

from __future__ import annotations

import torch
from loop_probes import SMALL, small_model

from flowcredit.models import load_model
from flowcredit.models.diffusers_common import pretrained_options
from flowcredit.presets import load_config
from flowcredit.run.session import build_session


def test_guidance_scale_one_reaches_the_adapter_as_one(tmp_path):
    model_dir = small_model(tmp_path / "model")  # its own default guidance is the built-in's, 2.0
    flags = [x for k, v in SMALL.items() for x in (f"--{k}", str(v))]
    flags += ["--checkpoint", model_dir, "--run_dir", str(tmp_path / "run")]
    assert load_model(load_config("flow_grpo", None, flags)).guidance_scale == 2.0  # no flag: the default

    cfg = load_config("flow_grpo", None, [*flags, "--guidance_scale", "1"])
    assert cfg.guidance_scale == 1.0
    assert pretrained_options(cfg)["guidance_scale"] == 1.0  # what every diffusers loader is given
    s = build_session(cfg)
    assert s.model.guidance_scale == 1.0 and s.guidance_passes == 1
    # w = 1: v_null + 1·(v_cond − v_null) = v_cond, the conditional pass alone (w = 2 would differ)
    x = torch.randn((2, *s.model.latent_shape), generator=torch.Generator().manual_seed(0))
    sigma, cond = torch.tensor([0.7, 0.3]), s.model.encode(["a red circle", "a blue square"])
    with torch.no_grad():
        assert torch.equal(s.model.velocity(x, sigma, cond), s.model.predict(x, sigma, cond))
