"""``flowcredit bench``'s plan: the cheap-value rows, one ψ for every calibrating cell, parallel runs."""

from __future__ import annotations

import argparse
import json

import pytest

from flowcredit.commands import bench
from flowcredit.errors import UserError
from flowcredit.presets import load_config


def _args(**kw):
    base = dict(
        presets="flow_grpo,dense_grpo,stepwise_grpo,tp_grpo", quick=True, ablations=False, task="demo"
    )
    return argparse.Namespace(
        **{**base, "minutes": 0.0, "iterations": None, "no_cheap": False, "jobs": 1, **kw}
    )


def test_cheap_value_rows_sit_beside_their_presets():
    names = [c["name"] for c in bench.plan_cells(_args(), [])]
    assert names == [
        "flow_grpo",
        "dense_grpo",
        "dense_grpo-euler1",
        "stepwise_grpo",
        "tp_grpo",
        "tp_grpo-euler1",
    ]
    cells = {c["name"]: c for c in bench.plan_cells(_args(), [])}
    cfg = load_config("tp_grpo", None, cells["tp_grpo-euler1"]["overrides"])
    assert (cfg.estimator, cfg.substeps, cfg.credit) == ("euler", 1, "turning_point")
    assert [c["name"] for c in bench.plan_cells(_args(no_cheap=True), [])] == _args().presets.split(",")


def test_stepwise_ablations_are_valid_configs():
    cells = {c["name"]: c for c in bench.plan_cells(_args(ablations=True, presets="stepwise_grpo"), [])}
    for name in ("stepwise_grpo-per_step_norm", "stepwise_grpo-centred", "stepwise_grpo-shared_noise"):
        load_config("stepwise_grpo", None, cells[name]["overrides"])  # raises on an invalid combination
    assert load_config("stepwise_grpo", None, cells["stepwise_grpo-shared_noise"]["overrides"]).shared_noise


def test_compare_task_evaluates_every_held_out_prompt():
    cfg = load_config("flow_grpo", None, bench.TASKS["compare"]())
    assert (cfg.num_eval_prompts, cfg.eval_samples_per_prompt, cfg.iterations) == (0, 4, 10)
    assert cfg.calib_max_iters == load_config("dense_grpo").calib_max_iters  # the config's own rule


def test_one_psi_for_every_calibrating_cell(tmp_path, monkeypatch):
    calls = []

    def fake_calibrate(argv):
        calls.append(argv)
        run_dir = tmp_path / "psi"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "psi.json").write_text(json.dumps({"psi": [0.5] * 5}))
        return 0

    from flowcredit.commands import calibrate

    monkeypatch.setattr(calibrate, "main", fake_calibrate)
    cells = bench.shared_psi(bench.plan_cells(_args(), []), tmp_path)
    assert len(calls) == 1  # dense_grpo and dense_grpo-euler1 share it
    for c in cells:
        cfg = load_config(c["preset"], None, c["overrides"])
        assert not cfg.calibrate
        assert cfg.psi_path == (str(tmp_path / "psi" / "psi.json") if c["preset"] == "dense_grpo" else "")
    bench.shared_psi(bench.plan_cells(_args(), []), tmp_path)
    assert len(calls) == 1  # reused, not recomputed
    mixed = bench.plan_cells(_args(presets="dense_grpo"), [])
    mixed[1] = mixed[1] | {"overrides": mixed[1]["overrides"] + ["--calib_groups", "3"]}
    with pytest.raises(UserError, match="calibrate differently"):
        bench.shared_psi(mixed, tmp_path / "other")


def test_parallel_cpu_runs_split_the_threads_unless_told():
    def threads(jobs, rest):
        cells = bench.plan_cells(_args(presets="flow_grpo", no_cheap=True, jobs=jobs), rest)
        return [load_config(c["preset"], None, c["overrides"]).threads for c in cells]

    assert threads(1, []) == [2]  # the config's default
    assert threads(2, []) == [1]
    assert threads(3, []) == [1]  # never below one
    assert threads(2, ["--threads", "4"]) == [4]
    assert threads(2, ["--threads", "2"]) == [2]  # named: kept as given
    assert threads(2, ["--device", "cuda"]) == [2]  # a GPU run's threads are the user's


def test_parallel_runs_and_report_only(tmp_path):
    out = tmp_path / "bench"
    argv = ["--quick", "--presets", "flow_grpo", "--no_cheap", "--seeds", "0,1", "--out", str(out)]
    assert bench.main([*argv, "--jobs", "2", "--iterations", "1"]) == 0
    first = json.loads((out / "results.json").read_text())
    assert {k: len(v) for k, v in first["runs"].items()} == {"flow_grpo": 2}
    assert (out / "runs" / "flow_grpo-seed1.log").is_file()
    assert bench.main([*argv, "--iterations", "1", "--report_only"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["runs"]["flow_grpo"][1]["points"] == first["runs"]["flow_grpo"][1]["points"]


def test_variants_are_paired_with_their_own_preset():
    from flowcredit.commands.bench_stats import ablation_differences

    def run(seed, final):
        return {
            "seed": seed,
            "noise_floor": 0.01,
            "nfe_per_iteration": [1, 0, 1],
            "points": [
                {"soft": 0.5, "strict": 0.2, "train": 0.5},
                {"soft": final, "strict": 0.2, "train": final},
            ],
        }

    results = {
        "flow_grpo": [run(0, 0.9), run(1, 0.9)],
        "tp_grpo": [run(0, 0.6), run(1, 0.7)],
        "tp_grpo-beta": [run(0, 0.7), run(1, 0.9)],
    }
    got = ablation_differences(results)
    assert set(got) == {"tp_grpo-beta"}
    assert got["tp_grpo-beta"]["diff_per_seed"]["train"] == pytest.approx([0.1, 0.2])  # against tp_grpo


def test_a_run_saved_before_a_field_was_added_resumes_if_the_field_holds_its_default():
    """A grid parked before a config field existed resumes under code that has it, as long as the new
    field keeps the behaviour the run had (its default); its location never counts."""
    import dataclasses

    from flowcredit.commands.bench import same_settings
    from flowcredit.config import Config

    now = dataclasses.asdict(Config(run_dir="/b/run"))
    added = "kl_mode"  # pretend this field is new since the run was saved
    saved = {k: v for k, v in now.items() if k != added} | {"run_dir": "/a/run"}
    assert same_settings(saved, now)
    default = now[added]
    changed = now | {added: "something else" if isinstance(default, str) else not default}
    assert not same_settings(saved, changed)
    assert not same_settings(saved | {"lr": 1.0}, now)
