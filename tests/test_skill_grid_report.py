"""benchmarks/skill_grid/skill_grid_report.py: the skill grid's table, results.json and figures from
published runs (the report's arithmetic itself: tests/test_bench_skill.py)."""

import pytest
from test_bench_skill import CATS, _record


def _grid_report():
    """benchmarks/skill_grid/skill_grid_report.py as a module."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "skill_grid" / "skill_grid_report.py"
    spec = importlib.util.spec_from_file_location("skill_grid_report", script)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_a_run_published_without_its_calls_stands_at_its_arms_mean():
    """The figure's dots: calls from the training curve; a run without one at its arm's logged mean."""
    report = _grid_report()
    records = {
        f"skill-seed{s}": {"config": {"seed": s}, "curve": {"nfe": [n / 2, n]}}
        for s, n in ((10, 2e6), (11, 4e6))
    }
    records["skill-seed12"] = {"config": {"seed": 12}}  # published before runs carried their curve
    arm = {
        "seeds": [10, 11, 12],
        "per_seed": {s: {"strict": {"overall": v}} for s, v in ((10, 0.3), (11, 0.4), (12, 0.5))},
    }
    points = report.figures.run_points("skill", arm, records, base=0.2)
    assert [(x, round(y, 9), logged) for x, y, logged in points] == [
        (2.0, 0.1, True),
        (4.0, 0.2, True),
        (3.0, 0.3, False),
    ]
    assert report.figures.run_points("skill", arm, {}, base=0.2) == []  # no run logged its calls: no dots


def _publish(tmp_path, records: dict, report, monkeypatch) -> None:
    """``records`` as published runs under ``tmp_path/runs``, the report set to two categories."""
    import json

    (tmp_path / "runs").mkdir()
    for name, rec in records.items():
        (tmp_path / "runs" / f"{name}.json").write_text(json.dumps(rec))
    monkeypatch.setattr(
        report, "load_prompts", lambda split: [{"prompt": p, "category": c} for p, c in CATS.items()]
    )
    monkeypatch.setattr(report, "CATEGORIES", ("colors", "counting"))
    monkeypatch.setattr(report.figures, "PARTS", ("overall", "per_image", "colors", "counting"))


def test_the_grid_report_writes_its_table_json_and_figure(tmp_path, monkeypatch):
    import json
    import sys

    from PIL import Image

    report = _grid_report()
    records = {"base-heldout": _record(0.2), "skill-seed10": _record(0.3), "skill-tp-seed10": _record(0.36)}
    records["skill-seed10"]["curve"] = {"iteration": [1, 2], "reward": [0.2, 0.4], "nfe": [960, 1920]}
    _publish(tmp_path, records, report, monkeypatch)
    parked = tmp_path / "inflight" / "skill-tp-seed11"
    (parked / "checkpoint").mkdir(parents=True)
    (parked / "checkpoint" / "state.json").write_text(json.dumps({"iteration": 12}))
    (parked / "config.json").write_text(json.dumps({"iterations": 450}))
    stale = tmp_path / "inflight" / "skill-tp-seed10"  # parked once, finished since: not "parked"
    (stale / "checkpoint").mkdir(parents=True)
    (stale / "checkpoint" / "state.json").write_text(json.dumps({"iteration": 191}))
    (stale / "config.json").write_text(json.dumps({"iterations": 450}))
    times = {"cpu": {"model": "AMD EPYC"}, "threads": 2, "arms": {"skill": 5.0, "tp": 10.5}}
    (tmp_path / "iteration_times.json").write_text(json.dumps(times))  # skill_rate.py --arms --out
    monkeypatch.setattr(sys, "argv", ["skill_grid_report.py", str(tmp_path)])
    report.main()
    rep = json.loads((tmp_path / "results.json").read_text())
    assert (
        "side in one run (`benchmarks/speed/skill_rate.py --arms`, best of its repeats; AMD EPYC,"
        in (tmp_path / "table.md").read_text()
    )
    ratios = [report.time_ratio(arm, times) for arm in ("skill", "skill-tp", "skill-dense")]
    assert ratios == ["1.00×", "2.10×", ""]
    assert report.time_ratio("skill-tp", times, 1 / 3) == "2.10× (0.70× per run)"
    later = {"date": "2026-12-06", "cpu": {"model": "AMD EPYC"}, "threads": 2}
    times["later"] = [later | {"arms": {"skill": 4.0, "coca": 5.0, "tp": 4.0}}]  # skill_rate.py --later
    assert report.time_ratio("skill-coca", times) == "1.25×"  # its own run's ratio
    assert report.time_ratio("skill-tp", times) == "2.10×"  # timed first: the first run's stands
    cost = {"n": 2, "nfe_per_iteration": 1816, "train_nfe": 817200, "calibration_nfe": 0, "cpu_minutes": 70}
    table = report.cost_table({"skill-coca": cost}, False, times)
    assert "| skill-coca | 2 | 1,816 | 817,200 | 0 | 1.25× | 70 |" in table
    assert "in a run of their own (2026-12-06, AMD EPYC, 2 threads): `coca`." in "\n".join(table)
    assert rep["paired"]["skill-tp"]["diff"]["strict/overall"][0] == pytest.approx(0.06)
    assert "| skill-tp | 10 | +0.060 (one seed)" in (tmp_path / "table.md").read_text()
    assert "Finished and evaluated: skill-seed10, skill-tp-seed10." in (tmp_path / "table.md").read_text()
    assert (
        "resumable (docs/benchmarks.md): skill-tp-seed11 (checkpoint at iteration 12 of 450)."
        in (tmp_path / "table.md").read_text()
    )
    assert Image.open(tmp_path / "compare.png").size[0] > 500
    assert Image.open(tmp_path / "curves.png").size[0] > 500
    assert report.figures._smooth([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]


def test_runs_before_a_fix_of_their_update_rule_are_marked():
    """A run of a rule that FIXES changed predates the fix unless every start of it (provenance) came
    after the fix's time; the table marks its arm † in every section and says which seeds ran before."""
    from flowcredit.commands.bench_skill_report import FIXES, fixes_missed, skill_report

    commit, at, _, _ = FIXES[0]  # awm, nft: 2026-12-06T01:13:31Z
    after, before = {"time": "2026-12-06T02:00:00Z"}, {"time": "2026-12-06T01:00:00Z"}
    assert fixes_missed({"config": {"update": "nft"}}) == [commit]  # no provenance: published before it
    assert fixes_missed({"config": {"update": "awm"}, "provenance": [before, after]}) == [commit]  # resumed
    assert fixes_missed({"config": {"update": "awm"}, "provenance": [after, after]}) == []
    assert fixes_missed({"config": {"update": "clipped"}}) == []
    records = {"base-heldout": _record(0.2), "skill-seed10": _record(0.3), "skill-seed11": _record(0.4)}
    for seed, prov in ((10, []), (11, [after])):
        records[f"skill-nft_quarter-seed{seed}"] = {**_record(0.35), "config": {"update": "nft"}}
        records[f"skill-nft_quarter-seed{seed}"]["provenance"] = prov
    rep = skill_report(records, CATS)
    assert rep["arms"]["skill-nft_quarter"]["before_fix"] == {commit: [10]}
    assert rep["paired"]["skill-nft_quarter"]["before_fix"] == {commit: [10]}
    assert rep["arms"]["skill"]["before_fix"] == {}
    report = _grid_report()
    report.CATEGORIES = ("colors", "counting")
    text = report.table(rep)
    assert f"† Run before the fix of 2026-12-06 (commit {commit})" in text
    assert "Runs: skill-nft_quarter (seeds 10)." in text
    marked = [line for line in text.splitlines() if line.startswith("| skill-nft_quarter † |")]
    assert len(marked) == 3  # the arms, their paired differences, the verdicts
    assert "with 1/4 of its network calls | skill-nft_quarter † | 2 |" in text  # the claim
    assert "| skill † |" not in text and "| skill |" in text


def test_the_confirmation_set_gets_a_section_of_its_own(tmp_path, monkeypatch):
    """Runs scored on the confirmation set (``"confirm"``, the base's too) are reported apart, paired
    only where Flow-GRPO has a confirmation score at the same seed; without the base's, no section."""
    import json
    import sys

    report = _grid_report()
    records = {
        name: _record(v) for name, v in (("base-heldout", 0.2), ("skill-seed10", 0.3), ("skill-seed11", 0.4))
    }
    for seed, v in ((10, 0.36), (11, 0.42), (12, 0.5)):
        records[f"skill-tp-seed{seed}"] = _record(v)
    records["skill-seed10"]["curve"] = {"iteration": [1, 2], "reward": [0.2, 0.4], "nfe": [960, 1920]}
    for name, v in (
        ("base-heldout", 0.1),
        ("skill-seed11", 0.2),
        ("skill-tp-seed11", 0.15),
        ("skill-tp-seed12", 0.3),
    ):
        records[name]["confirm"] = _record(v)["heldout"]
    _publish(tmp_path, records, report, monkeypatch)
    monkeypatch.setattr(sys, "argv", ["skill_grid_report.py", str(tmp_path)])
    report.main()
    rep = json.loads((tmp_path / "results.json").read_text())
    assert rep["paired"]["skill-tp"]["seeds"] == [10, 11]  # held-out: unchanged by the confirmation set
    assert rep["confirm"]["paired"]["skill-tp"]["seeds"] == [11]  # seed 12 has no Flow-GRPO pair
    assert rep["confirm"]["paired"]["skill-tp"]["diff"]["strict/overall"][0] == pytest.approx(-0.05)
    text = (tmp_path / "table.md").read_text().split("## The confirmation set")[1]
    assert "Base checkpoint: strict 0.100" in text and "| skill-tp | 11 | -0.050 (one seed)" in text
    assert "| skill-tp | 11,12 | +0.125 ± " in text  # over the base, every seed scored (0.15, 0.3 − 0.1)
    records["base-heldout"].pop("confirm")
    (tmp_path / "runs" / "base-heldout.json").write_text(json.dumps(records["base-heldout"]))
    report.main()
    assert "confirm" not in json.loads((tmp_path / "results.json").read_text())
