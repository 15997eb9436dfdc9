"""benchmarks/skill_grid/skill_grid_plan.py: the grid's runs in order, each run's state, and the seconds per
iteration it plans with, on hand-made folders."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "skill_grid" / "skill_grid_plan.py"
spec = importlib.util.spec_from_file_location("skill_grid_plan", SCRIPT)
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)


def test_the_runs_come_in_the_scripts_order_with_the_preset_first_and_once(tmp_path):
    script = tmp_path / "grid.sh"
    script.write_text("bench() { :; }\nbench tp 10,11\nbench stepwise,dense 10   # a comment\n  bench x 1\n")
    assert plan.grid_runs(script) == [
        ("skill", "skill-seed10"),
        ("tp", "skill-tp-seed10"),
        ("skill", "skill-seed11"),
        ("tp", "skill-tp-seed11"),
        ("stepwise", "skill-stepwise-seed10"),
        ("dense", "skill-dense-seed10"),
    ]


def test_the_grid_script_names_runs_the_bench_knows():
    from flowcredit.commands.bench_skill import SKILL_ARMS

    runs = plan.grid_runs(SCRIPT.parent / "skill_grid.sh")
    assert {arm for arm, _ in runs} - {"skill"} <= set(SKILL_ARMS)
    assert ("stepwise", "skill-stepwise-seed13") in runs


def test_a_run_is_published_parked_or_not_started(tmp_path):
    published, runs, parked = tmp_path / "published", tmp_path / "runs", tmp_path / "inflight"
    published.mkdir()
    (published / "skill-seed10.json").write_text("{}")
    for place, name, it in ((runs, "skill-tp-seed10", 61), (parked, "skill-tp-seed11", 12)):
        (place / name / "checkpoint").mkdir(parents=True)
        (place / name / "checkpoint" / "state.json").write_text(json.dumps({"iteration": it}))
    places = [runs, parked]
    assert plan.run_state("skill-seed10", places, published) == (None, "published")
    assert plan.run_state("skill-tp-seed10", places, published) == (61, "runs")
    assert plan.run_state("skill-tp-seed11", places, published) == (12, "inflight")
    assert plan.run_state("skill-tp-seed12", places, published) == (0, "not started")


def test_medians_of_the_runs_timings_and_side_by_side_times_scaled_to_them(tmp_path):
    for name, seconds in (("skill-tp-seed10", [10.0, 11.0, 400.0]), ("skill-tp-seed11", [12.0])):
        (tmp_path / name).mkdir()
        rows = [{"iteration": i, "time/iteration_s": s} for i, s in enumerate(seconds)]
        (tmp_path / name / "timings.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    measured = plan.median_seconds([tmp_path], least=4)
    assert measured == {"tp": 11.5}  # a paused iteration (400 s) does not move the median
    assert plan.median_seconds([tmp_path], least=5) == {}  # too few timed: the side-by-side times plan it
    speed = plan.seconds_per_iteration(measured, {"skill": 5.0, "tp": 10.0, "dense": 20.0})
    assert speed == pytest.approx({"tp": 11.5, "skill": 5.75, "dense": 23.0})
    assert plan.seconds_per_iteration({}, {"skill": 5.0}) == {"skill": 5.0}


def test_an_equal_nfe_arm_plans_its_own_iterations():
    assert plan.total_iterations("skill") == 450
    assert plan.total_iterations("tp_equal_nfe") == 150


def test_only_inconclusive_arms_get_more_seeds(tmp_path, monkeypatch):
    from test_bench_skill import CATS, _record

    import flowcredit.tasks.shapes as shapes

    monkeypatch.setattr(
        shapes, "load_prompts", lambda split: [{"prompt": p, "category": c} for p, c in CATS.items()]
    )
    runs = {"base-heldout": _record(0.2)}
    for seed, (flow, worse, unsure) in {10: (0.30, 0.10, 0.36), 11: (0.40, 0.21, 0.38)}.items():
        runs |= {f"skill-seed{seed}": _record(flow), f"skill-dense-seed{seed}": _record(worse)}
        runs[f"skill-stepwise-seed{seed}"] = _record(unsure)  # +0.06, −0.02: spans 0
    for name, record in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    # dense: −0.20, −0.19 (worse); tp: never ran
    assert plan.straddling(tmp_path, ["dense", "stepwise", "tp"]) == ["stepwise"]
