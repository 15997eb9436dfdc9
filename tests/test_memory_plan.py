"""``flowcredit memory`` (issue 57): the fake-tensor estimate against a real run, its JSON, its errors.

The check of the method: on a tiny random SD3 pipeline (``tiny_diffusers``), the same phases run once on
real CPU tensors and once on a fake copy of the same modules (shapes and dtypes only), both counted by
:class:`LiveStorages`; the fake run's update peak and saved activations must equal the real run's
within 2 %. The real-size estimate itself (the 2026-11-29 H200 check) is a command, documented in
docs/gpu.md ("Will it fit?"), not a test: it takes about 20 s.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_diffusers import build_sd3

from flowcredit import cli
from flowcredit.commands import memory_plan
from flowcredit.commands.memory_plan import PARTS, PHASES, LiveStorages, make_policy, run_phases
from flowcredit.presets import load_config

FIELDS = [
    "--model",
    "sd3",
    "--dtype",
    "float32",
    "--batch_size",
    "4",
    "--lora_rank",
    "4",
    "--prompts_per_iter",
    "2",
]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowcredit.models.sd3 import SD3FlowModel

    directory = build_sd3(tmp_path_factory.mktemp("sd3") / "pipe")
    return SD3FlowModel.from_pretrained(str(directory), dtype="float32", device="cpu")


def fake_copy(model):
    """A copy of the adapter whose every module holds fake tensors of the same shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    for module in [m for m in twin.pipe.components.values() if isinstance(m, torch.nn.Module)]:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = torch.nn.Parameter(mode.from_tensor(p), p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = mode.from_tensor(b)
    twin.net = twin.pipe.transformer
    twin.vae = twin.pipe.vae
    return twin, mode


def phases(model, cfg, mode=None):
    if mode is None:
        return run_phases(cfg, model, make_policy(cfg, model))
    saved_to = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self  # fake parameters cannot be swapped (memory_plan)
    try:
        with mode:
            policy = make_policy(cfg, model)
    finally:
        torch.nn.Module.to = saved_to
    return run_phases(cfg, model, policy)


def test_fake_estimate_equals_the_real_runs_counted_peak(tiny_sd3):
    cfg = load_config("flow_grpo", None, FIELDS)
    real = phases(copy.deepcopy(tiny_sd3), cfg)
    fake_model, mode = fake_copy(tiny_sd3)
    fake = phases(fake_model, cfg, mode)
    assert set(real["phases"]) == set(fake["phases"]) == set(PHASES)
    for phase in PHASES:
        r, f = real["phases"][phase], fake["phases"][phase]
        assert f["weights"] == r["weights"] and f["optimizer"] == r["optimizer"], phase
        assert f["peak"] == pytest.approx(r["peak"], rel=0.02), phase
    upd_r, upd_f = real["phases"]["update"], fake["phases"]["update"]
    assert upd_r["activations"] > 0.3 * (upd_r["peak"] - upd_r["weights"])  # the update's peak is activations
    assert upd_f["activations"] == pytest.approx(upd_r["activations"], rel=0.02)
    assert real["attention_kernel"] == fake["attention_kernel"]


def test_gradient_checkpointing_lowers_the_update_activations(tiny_sd3):
    base = load_config("flow_grpo", None, FIELDS)
    ckpt = load_config("flow_grpo", None, [*FIELDS, "--gradient_checkpointing", "true"])
    plain = phases(copy.deepcopy(tiny_sd3), base)["phases"]["update"]
    saved = phases(copy.deepcopy(tiny_sd3), ckpt)["phases"]["update"]
    assert saved["activations"] < 0.6 * plain["activations"]


def test_live_storages_counts_what_stays_referenced():
    with LiveStorages() as counter:
        a = torch.zeros(1000)  # 4000 bytes
        b = a[:10]  # a view: no new storage
        c = torch.ones(500)
        del c
    assert counter.current == 4000 and counter.peak == 6000
    del a, b


def test_json_has_every_phase_and_part(monkeypatch, capsys):
    small = memory_plan.SD35_MEDIUM | dict(num_layers=2, num_attention_heads=2, attention_head_dim=16)
    small |= dict(caption_projection_dim=32, dual_attention_layers=(0,), pos_embed_max_size=16)
    monkeypatch.setitem(memory_plan.SIZES["sd3"], "test", small)
    monkeypatch.setattr(
        memory_plan, "SD3_VAE", memory_plan.SD3_VAE | dict(block_out_channels=(32, 32, 32, 32))
    )
    monkeypatch.setattr(
        memory_plan, "TINY_TEXT", dict(num_hidden_layers=1, intermediate_size=8, num_attention_heads=1)
    )
    argv = [
        "memory",
        "--size",
        "test",
        "--tiny_text_encoders",
        "--resolution",
        "64",
        "--batch_size",
        "2",
        "--json",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["phases"]) == set(PHASES)
    for phase in PHASES:
        assert set(out["phases"][phase]) == {*PARTS, "peak"}
        assert out["phases"][phase]["peak"] == sum(out["phases"][phase][k] for k in PARTS)
    assert out["peak"] == max(p["peak"] for p in out["phases"].values())
    assert out["settings"]["transformer_rows"] == 4 and out["attention_kernel"]


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--batch_sizee", "8"], "batch_sizee"),
        (["--size", "huge"], "'size'"),
        (["--model", "wan"], "'model'"),
        (["--dtype", "float8"], "'dtype'"),
    ],
)
def test_a_bad_field_names_itself(argv, culprit, capsys):
    assert cli.main(["memory", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0], err
