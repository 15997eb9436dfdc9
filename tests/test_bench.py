"""``flowcredit bench``: the quick comparison end to end, resumability, and its statistics."""

import argparse
import json
import math

import pytest

from flowcredit.commands import bench, bench_report


def test_quick_bench_writes_results_and_is_resumable(tmp_path, monkeypatch):
    out = tmp_path / "bench"
    argv = ["--quick", "--presets", "flow_grpo,tp_grpo", "--seeds", "0", "--out", str(out)]
    assert bench.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"flow_grpo", "tp_grpo"}
    for name, runs in results["runs"].items():
        (run,) = runs
        assert run["iterations"] == 2
        its = [p["iteration"] for p in run["points"]]
        assert its == [0, 1, 2], its  # quick evaluates every iteration
        assert run["points"][0]["nfe"] == 0 and run["points"][0]["seconds"] == 0
        assert all(
            b["nfe"] > a["nfe"] and b["seconds"] > a["seconds"]
            for a, b in zip(run["points"], run["points"][1:])
        )
        assert run["noise_floor"] is not None and run["noise_floor"] >= 0
        rollout, values, update = run["nfe_per_iteration"]
        assert rollout > 0 and update >= 0
        assert (values > 0) == (name == "tp_grpo")  # flow_grpo needs no intermediate values
    table = (out / "table.md").read_text()
    assert "| flow_grpo |" in table and "| tp_grpo |" in table and "(one seed)" in table
    for key in ("iteration", "seconds", "nfe"):
        assert (out / f"reward_vs_{key}.png").stat().st_size > 1000
    assert (out / "categories.png").stat().st_size > 1000  # held-out per-category bars
    assert results["table"][0]["primary"] == "train"  # the demo task trains on 4 prompts: scored too
    for run in results["runs"]["flow_grpo"]:
        assert all("train" in p for p in run["points"]) and run["categories_final"]

    # a second invocation reads the finished runs: no training at all, same numbers
    stamp = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("metrics.jsonl")}

    def no_training(*args, **kwargs):
        raise AssertionError("a finished cell was recomputed")

    monkeypatch.setattr("flowcredit.train.train", no_training)
    assert bench.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in stamp} == stamp
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]


def test_changed_config_is_not_mixed_into_an_existing_bench(tmp_path):
    cfg_dir = tmp_path / "runs" / "flow_grpo-seed0"
    cfg_dir.mkdir(parents=True)
    (cfg_dir / "config.json").write_text(json.dumps({"seed": 0}))
    cell = bench.plan_cells(_args(), [])[0]
    with pytest.raises(ValueError, match="another config"):
        bench.run_cell(cell, 0, tmp_path / "runs")


def _args(**kw):
    base = dict(
        presets="flow_grpo,dense_grpo,stepwise_grpo,tp_grpo", quick=True, ablations=False, task="demo"
    )
    return argparse.Namespace(**{**base, "minutes": 0.0, "iterations": None, **kw})


def test_ablations_and_budgets_are_planned():
    cells = {c["name"]: c for c in bench.plan_cells(_args(ablations=True, minutes=1.5), ["--lr", "3e-4"])}
    assert {
        "tp_grpo-no_constraint",
        "tp_grpo-no_first_step",
        "tp_grpo-no_balance",
        "tp_grpo-half_window",
    } < set(cells)
    assert {"stepwise_grpo-per_step_norm", "dense_grpo-uniform_noise", "dense_grpo-euler1"} < set(cells)
    from flowcredit.config import load_config

    cfg = load_config("tp_grpo", None, cells["tp_grpo-half_window"]["overrides"])
    assert (cfg.window_size, cfg.max_minutes, cfg.lr, cfg.num_steps) == (2, 1.5, 3e-4, 5)  # quick: 4 → 2
    assert (
        load_config("stepwise_grpo", None, cells["stepwise_grpo-per_step_norm"]["overrides"]).credit
        == "dense"
    )
    with pytest.raises(ValueError, match="--seeds"):
        bench.plan_cells(_args(), ["--seed", "3"])


def test_confidence_interval_and_mean_curve():
    mean, half = bench_report.ci95([0.4, 0.5, 0.6])
    assert mean == pytest.approx(0.5)
    assert half == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)  # t_{0.975, 2} · s / √n
    assert math.isnan(bench_report.ci95([0.3])[1])
    runs = [
        {
            "points": [
                {"iteration": i, "seconds": 2.0 * i, "nfe": 10 * i, "soft": s} for i, s in zip((0, 5, 10), v)
            ]
        }
        for v in ((0.2, 0.4, 0.6), (0.4, 0.6))  # the second seed stopped early (wall-clock budget)
    ]
    curve = bench_report.mean_curve(runs)
    assert [p["iteration"] for p in curve] == [0, 5]
    assert [p["soft"] for p in curve] == pytest.approx([0.3, 0.5])


def _run(points, cats=None):
    pts = [
        {"iteration": i, "seconds": t, "nfe": 10 * i, "soft": 0.5, "strict": 0.2, "train": v}
        for i, t, v in points
    ]
    return {
        "points": pts,
        "iterations": pts[-1]["iteration"],
        "seconds": pts[-1]["seconds"],
        "noise_floor": 0.01,
        "train_floor": 0.02,
        "nfe_per_iteration": [1, 2, 3],
        "setup_seconds": 5.0,
        "categories_start": cats or {},
        "categories_final": cats or {},
    }


def test_summary_reach_and_equal_seconds_on_the_trained_prompts():
    results = {
        "flow_grpo": [_run([(0, 0, 0.6), (2, 20, 0.65), (4, 40, 0.7)])] * 2,  # budget 40 s, target 0.7
        "dense_grpo": [_run([(0, 0, 0.6), (2, 50, 0.75), (4, 100, 0.8)])] * 2,
    }
    cells = [{"name": n} for n in results]
    flow, dense = bench_report.summarise(cells, results)
    assert flow["primary"] == "train" and flow["target"] == pytest.approx(0.7)
    assert (dense["reach_iteration"], dense["reach_seconds"]) == (2, 50)
    assert (dense["at_flow_seconds"], dense["at_flow_seconds_iteration"]) == (
        0.6,
        0,
    )  # only iteration 0 ≤ 40 s
    assert (flow["at_flow_seconds"], flow["at_flow_seconds_iteration"]) == (pytest.approx(0.7), 4)
    assert dense["train"][0] == pytest.approx(0.8) and dense["train_start"] == pytest.approx(0.6)
