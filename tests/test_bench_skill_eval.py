"""The skill bench's two evaluations (flowcredit/commands/bench_skill_eval.py): every finished run and
the base on the held-out set and on the confirmation set, published together; runs published with
their weights scored on the confirmation set later, training nothing."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from flowcredit.commands import bench_skill_eval as E
from flowcredit.commands.bench import main as bench_main
from flowcredit.commands.bench import plan_cells
from flowcredit.commands.bench_skill import after_run, publish
from flowcredit.errors import UserError
from flowcredit.presets import load_config
from flowcredit.tasks.prompt_sets import read_prompts


@pytest.fixture
def evals(monkeypatch):
    """``flowcredit eval`` replaced by a fake that writes a whole evaluation of its ``--prompts`` (its
    ``checkpoint``: the absolute ``--config`` it was given) and records every argv."""
    calls = []

    def fake_call(argv, **kw):
        calls.append(argv)
        flag = dict(zip(argv[4::2], argv[5::2]))  # python -m flowcredit eval --flag value ...
        out, prompts = Path(flag["--out"]), flag["--prompts"]
        rows = len(read_prompts(prompts)) * int(flag["--samples-per-prompt"])
        result = {"prompts": prompts, "seeds": [int(s) for s in flag["--seeds"].split(",")]}
        result |= {
            "sample_prompts": ["p"] * rows,
            "checkpoint": str(Path(flag.get("--config", "b")).absolute()),
        }
        out.mkdir(parents=True)
        (out / "eval.json").write_text(json.dumps(result))
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    return calls


def _flags(argv):
    return dict(zip(argv[4::2], argv[5::2]))


def test_a_finished_run_is_evaluated_and_published_on_both_sets(tmp_path, evals):
    run = tmp_path / "runs" / "skill-seed14"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 14, "threads": 2}))
    assert E.final_eval(run, threads=2) == run / "heldout" / "eval.json"
    budgets = {
        _flags(a)["--prompts"]: (_flags(a)["--samples-per-prompt"], _flags(a)["--seeds"]) for a in evals
    }
    assert budgets == {"test": ("16", "7001,7002"), "confirm": ("4", "7001,7002")}
    assert len(read_prompts("confirm")) * 4 * 2 == 2400  # about the held-out set's 86 × 16 × 2 = 2,752
    record = json.loads(publish(run, tmp_path / "pub").read_text())
    assert record["heldout"]["prompts"] == "test" and record["confirm"]["prompts"] == "confirm"
    E.final_eval(run, threads=2)
    assert len(evals) == 2  # evaluated once


def _published(dest: Path, name: str, weights: bool = False, confirm: dict | None = None) -> None:
    record = {"run": name, "heldout": {"seeds": [7001, 7002]}} | ({"confirm": confirm} if confirm else {})
    (dest / f"{name}.json").write_text(json.dumps(record))
    if weights:
        (dest / name / "final").mkdir(parents=True)
        (dest / name / "final" / "trainable.safetensors").write_bytes(b"")
        (dest / name / "config.json").write_text("{}")


def test_published_runs_with_weights_are_scored_on_the_confirmation_set(tmp_path, evals):
    dest = tmp_path / "results" / "runs"
    dest.mkdir(parents=True)
    whole = {"seeds": [7001, 7002], "sample_prompts": ["p"] * 1200}
    _published(dest, "base-heldout")
    _published(dest, "skill-seed14", weights=True)
    _published(dest, "skill-seed10")  # published before runs kept their weights
    _published(dest, "skill-seed15", weights=True, confirm=whole)  # scored already
    _published(dest, "skill-seed16", weights=True, confirm={**whole, "seeds": [7001]})  # cut short
    cfg = load_config("skill", None, ["--device", "cuda:1"])
    done = E.score_published(dest, tmp_path / "scored", cfg)
    assert [p.stem for p in done] == ["base-heldout", "skill-seed14", "skill-seed16"]
    base, run = _flags(evals[0]), _flags(evals[1])
    assert base["--checkpoint"] == cfg.checkpoint and base["--device"] == "cuda:1"
    assert run["--config"] == str(dest / "skill-seed14" / "config.json") and run["--device"] == "cuda:1"
    assert {_flags(a)["--prompts"] for a in evals} == {"confirm"}
    record = json.loads((dest / "skill-seed14.json").read_text())
    assert record["heldout"] == {"seeds": [7001, 7002]}  # the rest of the record as it was
    assert record["confirm"]["checkpoint"] == "skill-seed14/config.json"  # relative to the record's folder
    assert "confirm" not in json.loads((dest / "skill-seed10.json").read_text())
    assert E.score_published(dest, tmp_path / "scored", cfg) == [] and len(evals) == 3


def test_a_bench_start_scores_what_was_published_without_the_confirmation_set(tmp_path, evals):
    dest = tmp_path / "runs"
    dest.mkdir()
    heldout = {"seeds": [7001, 7002], "sample_prompts": ["p"] * (86 * 16)}
    (dest / "base-heldout.json").write_text(json.dumps({"run": "base-heldout", "heldout": heldout}))
    _published(dest, "skill-seed14", weights=True)
    args = argparse.Namespace(
        presets="skill",
        task="skill",
        minutes=0,
        iterations=None,
        quick=False,
        jobs=1,
        ablations="",
        report_only=False,
        publish=str(dest),
    )
    after_run(args, plan_cells(args, []), tmp_path / "out")
    assert [_flags(a)["--prompts"] for a in evals] == ["confirm"] * 2  # the held-out base is not recomputed
    record = json.loads((dest / "base-heldout.json").read_text())
    assert record["heldout"] == heldout and E.whole(record["confirm"], "confirm")
    assert E.whole(json.loads((dest / "skill-seed14.json").read_text())["confirm"], "confirm")
    after_run(argparse.Namespace(**{**vars(args), "quick": True}), plan_cells(args, []), tmp_path / "q")
    assert len(evals) == 2 + 2  # --quick: its own small base (both sets), nothing published is scored


def test_bench_score_confirm(tmp_path, evals):
    dest = tmp_path / "runs"
    dest.mkdir()
    _published(dest, "skill-seed14", weights=True)
    argv = ["--task", "skill", "--presets", "skill", "--out", str(tmp_path / "out"), "--score_confirm"]
    with pytest.raises(UserError, match="--publish"):
        bench_main(argv)
    assert bench_main([*argv, "--publish", str(dest), "--device", "cpu"]) == 0
    assert [_flags(a)["--config"] for a in evals] == [str(dest / "skill-seed14" / "config.json")]
    assert list((tmp_path / "out" / "runs").iterdir()) == []  # nothing trained
