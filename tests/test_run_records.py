"""What a run leaves for later (issue 56): EMA snapshots during the run (``snapshot_every``) that
change nothing it computes, and a provenance line per start or resume."""

from __future__ import annotations

import json

import pytest
from loop_probes import small_config, small_model
from safetensors.torch import load_file

from flowcredit.errors import ConfigError
from flowcredit.train import train


def _run(tmp_path, name, **extra):
    cfg = small_config("flow_grpo", tmp_path / name, checkpoint=small_model(tmp_path / "model"), **extra)
    train(cfg)
    return tmp_path / name


def test_snapshots_change_nothing_and_hold_the_ema_weights(tmp_path):
    plain = _run(tmp_path, "plain", iterations=3)
    snap = _run(tmp_path, "snap", iterations=3, snapshot_every=2)
    assert (plain / "metrics.jsonl").read_bytes() == (snap / "metrics.jsonl").read_bytes()
    assert sorted(p.name for p in (snap / "snapshots").iterdir()) == ["iteration-0002"]  # 3 is final/
    # the snapshot at 2 is what a run of 2 iterations exports as final/ (the EMA weights)
    two = _run(tmp_path, "two", iterations=2)
    for name in ("trainable.safetensors", "model.safetensors"):
        got, want = load_file(snap / "snapshots/iteration-0002" / name), load_file(two / "final" / name)
        assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in got)
    assert not (plain / "snapshots").exists()


def test_provenance_line_per_start(tmp_path):
    run = _run(tmp_path, "run", iterations=1)
    train(small_config("flow_grpo", run, checkpoint=str(tmp_path / "model"), iterations=2), resume=True)
    lines = [json.loads(ln) for ln in (run / "provenance.jsonl").read_text().splitlines()]
    assert [ln["iteration"] for ln in lines] == [0, 1]
    import torch

    for line in lines:
        assert line["torch"] == torch.__version__ and line["threads"] == 2 and line["device"]
        assert set(line) >= {"commit", "dirty", "time"}


def test_snapshot_every_negative_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="snapshot_every"):
        small_config("flow_grpo", tmp_path / "r", snapshot_every=-1)
