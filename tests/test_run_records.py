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


def _weights(config=None, checkpoint=None):
    from types import SimpleNamespace

    from flowcredit.commands.eval import config_from_args, load_for_cli

    flags = dict(model=None, resolution=None, dtype=None, frames=None, device=None)
    args = SimpleNamespace(config=config and str(config), checkpoint=checkpoint and str(checkpoint), **flags)
    return load_for_cli(*config_from_args(args)).net.state_dict()


def _same(a, b):
    return a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_published_weights_load_as_the_run(tmp_path):
    """A published run keeps only its trained tensors (~270 KB, not the 3.7 MB merged checkpoint);
    loaded for evaluation they are bit for bit the run's own export, at the end and mid-run."""
    from flowcredit.commands.bench_skill import publish

    run = _run(tmp_path, "runs/r", iterations=2, snapshot_every=1)
    record = json.loads(publish(run, tmp_path / "pub").read_text())
    assert [p["iteration"] for p in record["provenance"]] == [0]
    published = tmp_path / "pub" / "r"
    assert sorted(p.name for p in published.iterdir()) == ["config.json", "final", "iteration-0001"]
    assert [p.name for p in (published / "final").iterdir()] == ["trainable.safetensors"]
    own, again = _weights(config=run / "config.json"), _weights(config=published / "config.json")
    base = _weights(checkpoint=tmp_path / "model")
    assert _same(own, again) and not _same(own, base)
    mid_own = _weights(checkpoint=run / "snapshots/iteration-0001")
    mid_again = _weights(checkpoint=published / "iteration-0001")
    assert _same(mid_own, mid_again) and not _same(mid_own, own)
