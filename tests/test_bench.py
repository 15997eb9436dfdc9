"""``flowcredit bench``: the quick comparison end to end, resumability, and its statistics."""

import argparse
import dataclasses
import json
import math

import pytest

from flowcredit.commands import bench, bench_report, bench_stats


def test_quick_bench_writes_results_and_is_resumable(tmp_path, monkeypatch):
    out = tmp_path / "bench"
    argv = ["--quick", "--presets", "flow_grpo,tp_grpo", "--no_cheap", "--seeds", "0", "--out", str(out)]
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


def test_a_grid_moved_to_another_directory_resumes(tmp_path):
    """A parked run restored into another clone: its config.json names the old run_dir, nothing else
    differs, and it has a checkpoint, so the bench resumes it (benchmarks/skill_grid/skill_grid_park.py)."""
    cell = bench.plan_cells(_args(), [])[0]
    runs = tmp_path / "moved" / "runs"
    _, cfg, _ = bench.plan_run(cell, 0, runs)
    run_dir = runs / "flow_grpo-seed0"
    (run_dir / "checkpoint").mkdir(parents=True)
    (run_dir / "checkpoint" / "state.json").write_text("{}")
    saved = dataclasses.asdict(cfg) | {"run_dir": "/elsewhere/runs/flow_grpo-seed0"}
    (run_dir / "config.json").write_text(json.dumps(saved))
    assert bench.plan_run(cell, 0, runs)[2] == "resume"
    (run_dir / "config.json").write_text(json.dumps(saved | {"lr": 1.0}))  # a real difference still stops it
    with pytest.raises(ValueError, match="another config"):
        bench.plan_run(cell, 0, runs)


def _args(**kw):
    base = dict(
        presets="flow_grpo,dense_grpo,stepwise_grpo,tp_grpo", quick=True, ablations=False, task="demo"
    )
    return argparse.Namespace(**{**base, "minutes": 0.0, "iterations": None, "jobs": 1, **kw})


def test_ablations_and_budgets_are_planned():
    cells = {c["name"]: c for c in bench.plan_cells(_args(ablations=True, minutes=1.5), ["--lr", "3e-4"])}
    assert {
        "tp_grpo-no_constraint",
        "tp_grpo-no_first_step",
        "tp_grpo-no_balance",
        "tp_grpo-half_window",
    } < set(cells)
    assert {"stepwise_grpo-per_step_norm", "dense_grpo-uniform_noise", "dense_grpo-euler1"} < set(cells)
    from flowcredit.presets import load_config

    cfg = load_config("tp_grpo", None, cells["tp_grpo-half_window"]["overrides"])
    assert (cfg.window_size, cfg.max_minutes, cfg.lr, cfg.num_steps) == (2, 1.5, 3e-4, 5)  # quick: 4 → 2
    assert (
        load_config("stepwise_grpo", None, cells["stepwise_grpo-per_step_norm"]["overrides"]).credit
        == "dense"
    )
    with pytest.raises(ValueError, match="--seeds"):
        bench.plan_cells(_args(), ["--seed", "3"])


def test_confidence_interval_and_mean_curve():
    mean, half = bench_stats.ci95([0.4, 0.5, 0.6])
    assert mean == pytest.approx(0.5)
    assert half == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)  # t_{0.975, 2} · s / √n
    assert math.isnan(bench_stats.ci95([0.3])[1])
    runs = [
        {
            "points": [
                {"iteration": i, "seconds": 2.0 * i, "nfe": 10 * i, "soft": s} for i, s in zip((0, 5, 10), v)
            ]
        }
        for v in ((0.2, 0.4, 0.6), (0.4, 0.6))  # the second seed stopped early (wall-clock budget)
    ]
    curve = bench_stats.mean_curve(runs)
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
    flow, dense = bench_stats.summarise(cells, results)
    assert flow["primary"] == "train" and flow["target"] == pytest.approx(0.7)
    assert (dense["reach_iteration"], dense["reach_seconds"]) == (2, 50)
    assert (dense["at_flow_seconds"], dense["at_flow_seconds_iteration"]) == (
        0.6,
        0,
    )  # only iteration 0 ≤ 40 s
    assert (flow["at_flow_seconds"], flow["at_flow_seconds_iteration"]) == (pytest.approx(0.7), 4)
    assert dense["train"][0] == pytest.approx(0.8) and dense["train_start"] == pytest.approx(0.6)


def _seeded(seed, train, soft=None, strict=None, floor=0.01):
    """A synthetic run of ``seed`` evaluated at iterations 0, 1, …: ``train`` (and optionally ``soft``,
    ``strict``) values per iteration, 10 s per iteration."""
    run = _run([(i, 10.0 * i, v) for i, v in enumerate(train)]) | {"seed": seed, "noise_floor": floor}
    for k, values in (("soft", soft), ("strict", strict)):
        for p, v in zip(run["points"], values or []):
            p[k] = v
    return run


def test_paired_differences_by_hand():
    from scipy import stats

    base = [
        _seeded(s, [0.6, f], soft=[0.5, 0.5], strict=[0.2, st])
        for s, f, st in ((0, 0.70, 0.20), (1, 0.75, 0.30), (2, 0.80, 0.25))
    ]
    cell = [  # listed in another order than the baseline: matched by seed, not by position
        _seeded(2, [0.6, 0.81], soft=[0.5, 0.51], strict=[0.2, 0.25]),
        _seeded(0, [0.6, 0.72], soft=[0.5, 0.45], strict=[0.2, 0.21]),  # held-out harm: −0.05 < −2·0.01
        _seeded(1, [0.6, 0.80], soft=[0.5, 0.49], strict=[0.2, 0.30]),
    ]
    paired = bench_stats.paired_differences({"flow_grpo": base, "tp_grpo": cell})
    p = paired["tp_grpo"]
    assert p["n"] == 3 and p["paired_seeds"] == [2, 0, 1]
    d = [0.01, 0.02, 0.05]  # train: 0.81 − 0.80, 0.72 − 0.70, 0.80 − 0.75
    m = sum(d) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / 2)
    assert p["diff"]["train"][0] == pytest.approx(0.08 / 3)
    assert p["diff"]["train"][1] == pytest.approx(stats.t.ppf(0.975, 2) * sd / math.sqrt(3))
    assert p["diff_per_seed"]["soft"] == pytest.approx([0.01, -0.05, -0.01])
    assert p["diff"]["soft"][0] == pytest.approx(-0.05 / 3)
    assert p["diff"]["strict"][0] == pytest.approx((0.0 + 0.01 + 0.0) / 3)
    assert p["gain"]["train"] == pytest.approx([0.21, 0.12, 0.20])
    assert p["heldout_change"][0] == pytest.approx(-0.05 / 3) and p["harm_seeds"] == 1
    assert p["nfe_ratio"] == pytest.approx(1.0) and p["nfe_per_iteration"] == pytest.approx(6.0)
    assert "diff" not in paired["flow_grpo"] and paired["flow_grpo"]["harm_seeds"] == 0
    assert paired["flow_grpo"]["heldout_change"] == (0.0, 0.0)


def test_paired_differences_use_only_the_seeds_both_ran():
    base = [_seeded(s, [0.6, 0.7 + 0.01 * s]) for s in (0, 1, 2)]
    cell = [_seeded(s, [0.6, 0.8]) for s in (1, 2, 3)]  # no seed 0; seed 3 has no baseline
    p = bench_stats.paired_differences({"flow_grpo": base, "dense_grpo": cell})["dense_grpo"]
    assert p["n"] == 2 and p["paired_seeds"] == [1, 2]
    assert p["diff_per_seed"]["train"] == pytest.approx([0.09, 0.08])
    assert p["seeds"] == [1, 2, 3] and len(p["gain"]["train"]) == 3  # own seeds: all three
    one = bench_stats.paired_differences({"flow_grpo": base, "dense_grpo": cell[:1]})["dense_grpo"]
    assert one["n"] == 1 and math.isnan(one["diff"]["train"][1])


def _curve(reach, last=10, start=0.6, target=0.8):
    """Primary score over iterations 0..last: ``start`` until it jumps to ``target`` at ``reach``
    (never when None)."""
    return [start + (target - start) * (reach is not None and i >= reach) for i in range(last + 1)]


def _claims(cell, reaches, base_final=0.8):
    results = {
        "flow_grpo": [_seeded(s, _curve(10, target=base_final)) for s in range(len(reaches))],
        cell: [_seeded(s, _curve(r)) for s, r in enumerate(reaches)],
    }
    (c,) = bench_stats.claims(results, bench_stats.summarise([{"name": n} for n in results], results))
    assert c["cell"] == cell
    return c


@pytest.mark.parametrize(
    "cell, reaches, expected",
    [
        ("tp_grpo", (3, 3, 4), "reproduced"),  # ratio 0.333 ± 0.143: mean ≤ 0.4, upper ≤ 0.5
        ("tp_grpo", (4, 5, 5), "inconclusive at n=3"),  # 0.467 ± 0.143: mean > 0.4, lower < 0.5
        ("tp_grpo", (8, 9, 10), "not reproduced"),  # lower bound 0.652 > 0.5
        ("tp_grpo", (3, None, None), "not reproduced"),  # most seeds never reach it
        ("tp_grpo", (3, 3, None), "inconclusive at n=3"),  # one never: cannot be reproduced
        ("tp_grpo-no_balance", (3,), "inconclusive at n=1"),
        ("stepwise_grpo", (4, 5, 5), "reproduced"),  # 0.467 ± 0.143: mean ≤ 0.5, upper ≤ 0.67
        ("stepwise_grpo", (9, 9, 10), "not reproduced"),  # lower bound 0.790 > 0.67
        ("stepwise_grpo", (2, 4, 8), "inconclusive at n=3"),  # 0.467 ± 0.758
    ],
)
def test_reach_claim_verdicts(cell, reaches, expected):
    assert _claims(cell, reaches)["verdict"] == expected


def test_reach_claim_needs_a_baseline_that_improved():
    c = _claims("tp_grpo", (1, 1, 1), base_final=0.6)  # Flow-GRPO's final = its start: nothing to reach
    assert c["verdict"] == "inconclusive at n=3" and "nothing to reach" in c["evidence"]


@pytest.mark.parametrize(
    "diffs, expected",
    [
        ((0.05, 0.06, 0.07), "reproduced"),  # lower bound > 0
        ((-0.05, -0.06, -0.07), "not reproduced"),  # upper bound < 0
        ((0.01, -0.01, 0.0), "not reproduced"),  # ±0.025 ≤ 0.03 around 0: no difference
        ((0.05, -0.05, 0.0), "inconclusive at n=3"),  # ±0.124: too wide
    ],
)
def test_dense_better_reward_verdicts(diffs, expected):
    results = {
        "flow_grpo": [_seeded(s, [0.6, 0.7]) for s in range(3)],
        "dense_grpo": [_seeded(s, [0.6, 0.7 + d]) for s, d in enumerate(diffs)],
    }
    (c,) = bench_stats.claims(results, bench_stats.summarise([{"name": n} for n in results], results))
    assert c["verdict"] == expected and c["cell"] == "dense_grpo"
    assert ("no difference larger than" in c["evidence"]) == (diffs == (0.01, -0.01, 0.0))


def test_table_has_the_paired_and_claims_sections(tmp_path):
    results = {
        "flow_grpo": [_seeded(s, _curve(10)) for s in range(3)],
        "tp_grpo": [_seeded(s, _curve(r)) for s, r in enumerate((3, 3, 4))],
        "dense_grpo": [_seeded(s, [0.6] * 10 + [0.8 + d]) for s, d in enumerate((0.01, 0.02, 0.05))],
    }
    cells = [{"name": n} for n in results]
    rep = bench_stats.report(cells, results)
    assert set(rep) == {"table", "paired", "variants", "claims"} and len(rep["table"]) == 3
    assert [c["cell"] for c in rep["claims"]] == ["tp_grpo", "dense_grpo"]
    bench_report.write_table(tmp_path, rep["table"], {}, results)
    table = (tmp_path / "table.md").read_text()
    assert "### Paired difference to Flow-GRPO (same seeds, 95 % t-interval)" in table
    assert "| dense_grpo | 3 | +0.027 ± 0.052 |" in table  # Δ trained of 0.01, 0.02, 0.05
    assert "| flow_grpo | 3 | — |" in table and "| 0 / 3 |" in table
    assert "### Paper claims" in table and "(tp_grpo): **reproduced**" in table
    assert "(dense_grpo): **inconclusive at n=3**" in table  # ±0.052 > 0.03 around +0.027
    bench_report.write_table(tmp_path, rep["table"], {})  # without results (or one seed): no sections
    assert "### Paired" not in (tmp_path / "table.md").read_text()
    one = {k: v[:1] for k, v in results.items()}
    bench_report.write_table(tmp_path, bench_stats.summarise(cells, one), {}, one)
    assert "### Paper claims" not in (tmp_path / "table.md").read_text()
