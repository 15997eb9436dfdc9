"""Parking the grid's unfinished runs through git keeps what a finished run publishes: its resumable
state and its mid-run snapshot's trained tensors (benchmarks/skill_grid/skill_grid_park.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _park_module():
    spec = importlib.util.spec_from_file_location(
        "skill_grid_park", ROOT / "benchmarks/skill_grid/skill_grid_park.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_parked_run_keeps_its_snapshots_and_comes_back_whole(tmp_path):
    park = _park_module()
    run = tmp_path / "runs" / "skill-dense-seed10"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "state.json").write_text(json.dumps({"iteration": 230}))
    (run / "config.json").write_text(json.dumps({"iterations": 450, "run_dir": "runs/x"}))
    (run / "provenance.jsonl").write_text('{"iteration": 0, "device": "AMD EPYC"}\n')
    (run / "snapshots" / "iteration-0225").mkdir(parents=True)
    (run / "snapshots" / "iteration-0225" / "trainable.safetensors").write_bytes(b"lora")
    (run / "snapshots" / "iteration-0225" / "model.safetensors").write_bytes(b"merged, 3.7 MB")
    assert park.park(tmp_path / "runs", tmp_path / "inflight") == ["skill-dense-seed10"]
    parked = tmp_path / "inflight" / "skill-dense-seed10"
    assert (parked / "snapshots/iteration-0225/trainable.safetensors").read_bytes() == b"lora"
    assert not (parked / "snapshots/iteration-0225/model.safetensors").exists()  # the tensors suffice
    assert park.restore(tmp_path / "elsewhere", tmp_path / "inflight") == ["skill-dense-seed10"]
    back = tmp_path / "elsewhere" / "skill-dense-seed10"
    assert (back / "snapshots/iteration-0225/trainable.safetensors").read_bytes() == b"lora"
    assert (back / "checkpoint" / "state.json").is_file() and (back / "provenance.jsonl").is_file()


def test_a_finished_unpublished_run_is_parked_until_it_is_published(tmp_path):
    park = _park_module()
    runs, inflight = tmp_path / "runs", tmp_path / "results" / "inflight"
    run = runs / "skill-dense-seed12"
    (run / "final").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"iterations": 450, "run_dir": "runs/x"}))
    (run / "summary.json").write_text(json.dumps({"iterations": 450}))
    (run / "final" / "trainable.safetensors").write_bytes(b"ema")
    (run / "final" / "model.safetensors").write_bytes(b"merged, 3.7 MB")
    (run / "confirm").mkdir()
    (run / "confirm" / "eval.json").write_text("{}")  # evaluated on one set, cut off before the other
    assert park.park(runs, inflight) == ["skill-dense-seed12"]
    parked = inflight / "skill-dense-seed12"
    assert (parked / "final/trainable.safetensors").read_bytes() == b"ema"
    assert (parked / "summary.json").is_file() and (parked / "confirm/eval.json").is_file()
    assert not (parked / "final/model.safetensors").exists() and not (parked / "checkpoint").exists()
    assert park.restore(tmp_path / "elsewhere", inflight) == ["skill-dense-seed12"]
    assert park.finished(tmp_path / "elsewhere" / "skill-dense-seed12")  # the bench evaluates, not retrains
    (tmp_path / "results" / "runs").mkdir()
    (tmp_path / "results" / "runs" / "skill-dense-seed12.json").write_text("{}")  # the bench published it
    assert park.park(runs, inflight) == []
    assert not parked.exists()
