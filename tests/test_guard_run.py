"""The reward-hacking guard in the training loop (flowcredit/run/guard.py): ``warn`` leaves training
as it is, ``rollback`` restores ``best/`` byte for byte, a run resumed after a rollback is the
uninterrupted one, ``stop`` ends the run, and bad settings name their field. The alarms are forced
(a saturation limit of 1e-9 fires at every evaluation after the start) on a small random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kill_points import Killed, install
from loop_probes import small_config, small_model

from flowcredit.errors import ConfigError
from flowcredit.run.checkpoint import load_checkpoint
from flowcredit.train import train

pytestmark = pytest.mark.slow

FORCED = dict(guard_saturation_delta=1e-9, guard_patience=1, guard_monitors="shapes_strict", eval_every=1)
STATE_FILES = ("trainable.safetensors", "optimizer.safetensors", "ema.safetensors")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return small_model(tmp_path_factory.mktemp("model") / "tiny16")


def run(model: str, run_dir: Path, **extra):
    cfg = small_config("flow_grpo", run_dir, checkpoint=model, ema_decay=0.9, **extra)
    return cfg, train(cfg)


def metrics(run_dir: Path, keep_guard: bool = True) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if keep_guard or not k.startswith("guard/")} for r in rows]


def test_warn_leaves_training_as_it_is(model, tmp_path):
    _, plain = run(model, tmp_path / "off", iterations=2, eval_every=1)
    _, warned = run(model, tmp_path / "warn", iterations=2, guard="warn", **FORCED)
    assert metrics(tmp_path / "warn", keep_guard=False) == metrics(tmp_path / "off")
    for name in STATE_FILES:
        assert (tmp_path / "warn/checkpoint" / name).read_bytes() == (
            tmp_path / "off/checkpoint" / name
        ).read_bytes()
    final = "final/trainable.safetensors"
    assert (tmp_path / "warn" / final).read_bytes() == (tmp_path / "off" / final).read_bytes()
    rows = metrics(tmp_path / "warn")
    assert [r.get("guard/alarm") for r in rows] == [0.0, 1.0, 1.0]  # the forced saturation alarm
    assert warned["guard"]["alarms"][0][0] == 1  # the start evaluation never alarms (no best to fall from)
    assert warned["guard"]["alarms"] == [[1, ["saturation"]], [2, ["saturation"]]]
    assert warned["guard"]["best"]["iteration"] == 0 and warned["guard"]["best"]["by"] == "shapes_strict"
    assert "guard" not in plain and not (tmp_path / "off/best").exists()
    assert (tmp_path / "warn/guard_curve.png").is_file()
    for key in ("trained", "shapes_strict", "diversity", "saturation", "high_freq", "histogram_tv"):
        assert f"guard/{key}" in rows[1], key
    assert rows[0]["guard/floor/shapes_strict"] >= 0


def test_rollback_restores_best_byte_for_byte(model, tmp_path):
    run_dir = tmp_path / "rollback"
    _, summary = run(model, run_dir, iterations=1, guard="rollback", guard_lr_scale=1.0, **FORCED)
    assert summary["guard"]["rollbacks"] == 1 and metrics(run_dir)[1]["guard/rollback"] == 1.0
    assert summary["guard"]["final_is_best"]  # iterations=1: the rollback was at the last evaluation
    for name in STATE_FILES:  # the checkpoint after the rollback is best/'s state (iteration 0)
        assert (run_dir / "checkpoint" / name).read_bytes() == (run_dir / "best/state" / name).read_bytes()
    # and the update had moved the weights: without the rollback they differ
    warned = tmp_path / "warned"
    run(model, warned, iterations=1, guard="warn", **FORCED)
    moved = (warned / "checkpoint/trainable.safetensors").read_bytes()
    assert moved != (run_dir / "best/state/trainable.safetensors").read_bytes()
    assert load_checkpoint(run_dir / "best/state")["iteration"] == 0
    # best/ is also a model (`flowcredit eval --checkpoint RUN/best`); final/, exported after the
    # rollback, is the same model
    for name in ("trainable.safetensors", "model.safetensors"):
        assert (run_dir / "final" / name).read_bytes() == (run_dir / "best" / name).read_bytes()


def test_resume_after_a_rollback_is_exact(model, tmp_path, monkeypatch):
    settings = dict(
        iterations=3, guard="rollback", guard_lr_scale=0.5, beta=0.01, guard_beta_scale=2.0, **FORCED
    )
    want = tmp_path / "whole"
    run(model, want, **settings)
    got = tmp_path / "resumed"
    cfg = small_config("flow_grpo", got, checkpoint=model, ema_decay=0.9, **settings)
    install("after_trainable", 2, "raise", monkeypatch.setattr)  # iteration 2's checkpoint write fails
    with pytest.raises(Killed):
        train(cfg)
    monkeypatch.undo()
    train(cfg, resume=True)  # from iteration 1, after its rollback
    assert (got / "metrics.jsonl").read_text() == (want / "metrics.jsonl").read_text()
    a, b = load_checkpoint(want / "checkpoint"), load_checkpoint(got / "checkpoint")
    assert a["extra"] == b["extra"] and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    for key in ("trainable", "ema"):
        assert all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    guard = b["extra"]["history"]["guard"]
    assert guard["rollbacks"] == 3 and guard["beta"] == pytest.approx(0.01 * 2**3)
    assert b["optimizer"]["param_groups"][0]["lr"] == pytest.approx(cfg.lr * 0.5**3)


def test_stop_waits_for_patience_then_ends_the_run(model, tmp_path):
    run_dir = tmp_path / "stop"
    _, summary = run(model, run_dir, iterations=4, guard="stop", **{**FORCED, "guard_patience": 2})
    assert summary["iterations"] == 2 and summary["stopped_early"]["by"] == "guard (alarm at iteration 2)"
    assert summary["guard"]["alarms"] == [[1, ["saturation"]], [2, ["saturation"]]]
    assert metrics(run_dir)[-1]["guard/stop"] == 1.0 and (run_dir / "best/state/state.json").is_file()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"guard": "maybe"}, "guard"),
        ({"guard": "warn", "eval_every": 1, "guard_monitors": "no_such_reward"}, "guard_monitors"),
        (
            {"guard": "warn", "eval_every": 1, "reward": "shapes", "guard_monitors": "shapes"},
            "guard_monitors",
        ),
        ({"guard": "rollback", "eval_every": 1, "guard_beta_scale": 2.0}, "guard_beta_scale"),
        ({"guard": "rollback", "eval_every": 1, "guard_lr_scale": 0.0}, "guard_lr_scale"),
        ({"guard": "warn", "eval_every": 1, "guard_patience": 0}, "guard_patience"),
        ({"guard": "warn", "eval_samples_per_prompt": 1, "eval_every": 1}, "guard_diversity_frac"),
        ({"guard": "warn", "eval_every": 0}, "eval_every"),
    ],
)
def test_bad_guard_settings_name_their_field(extra, field, tmp_path):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        small_config("flow_grpo", tmp_path / "run", **extra)


def test_monitor_options_reach_the_monitor_not_the_trained_reward():
    from flowcredit.config import Config
    from flowcredit.errors import UserError
    from flowcredit.run.session import build_reward

    options = json.dumps({"remote": {"url": "http://127.0.0.1:9"}})  # built, never called
    cfg = Config(guard="warn", guard_monitors="remote", reward_options=options)
    assert build_reward(cfg, cfg.reward).weights == {"shapes": 1.0}
    assert build_reward(cfg, "remote", named_only=True).weights == {"remote": 1.0}
    with pytest.raises(UserError, match="'remote', which is not in the reward spec"):
        build_reward(Config(reward_options=options), "shapes")  # no monitor of that name: a typo
