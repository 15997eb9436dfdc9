"""The skill comparison's pieces (flowcredit/commands/bench_skill.py and its report,
bench_skill_report.py): NFE by hand, the arms as planned cells, held-out scores and paired differences on
hand-made evaluations, the verdicts."""

import argparse
import math

import pytest

from flowcredit.commands.bench import plan_cells
from flowcredit.commands.bench_skill import (
    SKILL_ARMS,
    heldout_scores,
    nominal_calls,
    nominal_nfe,
    skill_report,
    skill_verdict,
)
from flowcredit.presets import load_config


def test_nominal_nfe_by_hand():
    # skill: 10 rollout steps; update: 5 trained steps × (policy + reference for β > 0)
    assert nominal_nfe(load_config("skill")) == 10 + 5 * 2
    # TP-GRPO credit: ode_remaining completions from states 0–4 (state 5 is copied: the rest is ODE)
    assert nominal_nfe(load_config("skill", None, ["--credit", "turning_point"])) == 20 + (10 + 9 + 8 + 7 + 6)
    # one-step values come from the rollout's own velocities (x̂0 = x − σ·v): no call (the trainer logs
    # nfe/values 0); two Euler substeps call the model from each of states 0–4 and their midpoints
    one_step = ["--credit", "dense", "--estimator", "euler", "--substeps", "1"]
    assert nominal_nfe(load_config("skill", None, one_step)) == 20
    two_steps = ["--credit", "dense", "--estimator", "euler", "--substeps", "2"]
    assert nominal_nfe(load_config("skill", None, two_steps)) == 20 + 5 * 2


def _skill_args(ablations: str) -> argparse.Namespace:
    """``flowcredit bench --task skill --presets skill --ablations ABLATIONS``, as its parser gives them."""
    return argparse.Namespace(
        presets="skill", task="skill", minutes=0, iterations=None, quick=False, jobs=1, ablations=ablations
    )


def test_the_arms_are_the_preset_with_one_change():
    args = _skill_args("tp,tp_equal_nfe")
    cells = {c["name"]: c for c in plan_cells(args, [])}
    assert list(cells) == ["skill", "skill-tp", "skill-tp_equal_nfe"]
    base = load_config("skill", None, cells["skill"]["overrides"])
    tp = load_config("skill", None, cells["skill-tp"]["overrides"])
    equal = load_config("skill", None, cells["skill-tp_equal_nfe"]["overrides"])
    assert tp.credit == "turning_point" and tp.iterations == base.iterations == 450
    assert equal.iterations == 150  # 450 × 20 / 60
    changed = {k for k, v in vars(tp).items() if getattr(base, k) != v}
    assert changed == {"credit"}


def test_the_diagnostic_arms_split_dense_euler1_into_its_credit_rule_and_its_sampler():
    """``dense_euler1`` = DenseGRPO credit + Dance-SDE with ψ calibrated; ``dense_euler1_cps`` changes
    only the credit fields, ``dance_psi`` only the sampler fields, and together they are ``dense_euler1``."""
    base = load_config("skill")

    def changed(arm):
        cfg = load_config("skill", None, SKILL_ARMS[arm])
        return {k: v for k, v in vars(cfg).items() if getattr(base, k) != v}

    credit, sampler = changed("dense_euler1_cps"), changed("dance_psi")
    assert credit == {"credit": "dense", "estimator": "euler", "substeps": 1}
    assert sampler == {"sampler": "dance_sde", "calibrate": True}
    assert changed("dense_euler1") == {**credit, **sampler}


def test_every_arm_is_a_valid_config_of_the_preset():
    """Each arm's overrides pass validation on the ``skill`` preset (a grid must not stop at an arm
    hours in), and the iterations of an equal-NFE arm give it the preset's network calls ±1 iteration
    (every row of an iteration counted: TreeGRPO's arm grows 27 leaves per prompt, the preset 12)."""
    base = load_config("skill")

    def per_iteration(cfg):
        return nominal_calls(cfg) * cfg.prompts_per_iter * cfg.group_size

    for name, change in SKILL_ARMS.items():
        overrides = change(base) if callable(change) else change
        arm = load_config("skill", None, overrides)
        if "--iterations" in overrides:
            share = 0.25 if name.endswith("_quarter") else 1.0
            budget = share * base.iterations * per_iteration(base)
            assert abs(arm.iterations * per_iteration(arm) - budget) <= per_iteration(arm), name


def _eval(strict_by_seed, soft_by_seed, prompts, k=2):
    return {
        "seeds": [1, 2],
        "samples_per_prompt": k,
        "sample_prompts": [p for p in prompts for _ in range(k)],
        "per_sample": {
            str(s): {"strict": strict_by_seed[i], "soft": soft_by_seed[i]} for i, s in enumerate((1, 2))
        },
    }


CATS = {"a red circle": "colors", "two squares": "counting", "one square": "counting"}
PROMPTS = ["a red circle", "two squares", "one square"]


def test_heldout_scores_by_hand():
    ev = _eval([[1, 0, 1, 1, 0, 0], [1, 1, 0, 0, 0, 1]], [[0.5] * 6, [1.0] * 6], PROMPTS)
    got = heldout_scores(ev, CATS)
    # seed 1: colors 0.5, counting (1+1+0+0)/4 = 0.5 → overall 0.5, per image 3/6
    # seed 2: colors 1.0, counting (0+0+0+1)/4 = 0.25 → overall 0.625, per image 3/6
    assert got["strict"]["colors"] == pytest.approx(0.75)
    assert got["strict"]["counting"] == pytest.approx(0.375)
    assert got["strict"]["overall"] == pytest.approx((0.5 + 0.625) / 2)
    assert got["strict"]["per_image"] == pytest.approx(0.5)
    assert got["soft"]["overall"] == pytest.approx(0.75)


def _record(strict_value):
    ones = [[strict_value] * 6, [strict_value] * 6]
    return {"heldout": _eval(ones, ones, PROMPTS)}


def test_paired_differences_and_verdicts_by_hand():
    records = {"base-heldout": _record(0.2)}
    for seed, (flow, tp) in {10: (0.30, 0.36), 11: (0.40, 0.42)}.items():
        records[f"skill-seed{seed}"] = _record(flow)
        records[f"skill-tp-seed{seed}"] = _record(tp)
    records["skill-tp_equal_nfe-seed10"] = _record(0.5)  # one seed only
    rep = skill_report(records, CATS)
    mean, half = rep["paired"]["skill-tp"]["diff"]["strict/overall"]
    assert mean == pytest.approx(0.04)  # (0.06 + 0.02) / 2
    sd = math.sqrt(((0.06 - 0.04) ** 2 + (0.02 - 0.04) ** 2) / 1)
    assert half == pytest.approx(12.7062 * sd / math.sqrt(2), rel=1e-4)  # t(0.975, 1) = 12.706
    assert rep["arms"]["skill"]["change_from_base"]["strict"][0] == pytest.approx(0.15)
    assert rep["arms"]["skill"]["change_by_part"]["strict/counting"][0] == pytest.approx(0.15)
    claims = {c["arm"]: c for c in rep["claims"]}
    assert claims["skill-tp"]["verdict"] == "inconclusive at n=2"  # 0.04 ± 0.254 spans 0
    assert (
        claims["skill-tp_equal_nfe"]["n"] == 1
        and claims["skill-tp_equal_nfe"]["verdict"] == "inconclusive at n=1"
    )


@pytest.mark.parametrize(
    "rule, mean, half, n, want",
    [
        ("better", 0.05, 0.02, 4, "reproduced"),
        ("better", -0.05, 0.02, 4, "not reproduced"),
        ("better", 0.0, 0.015, 4, "not reproduced"),  # equivalent within ±0.02
        ("better", 0.01, 0.05, 4, "inconclusive at n=4"),
        ("noninferior", -0.01, 0.005, 4, "reproduced"),
        ("noninferior", -0.05, 0.02, 4, "not reproduced"),
        ("noninferior", -0.01, 0.05, 4, "inconclusive at n=4"),
        ("better", 0.5, 0.01, 1, "inconclusive at n=1"),
    ],
)
def test_skill_verdicts(rule, mean, half, n, want):
    assert skill_verdict(rule, mean, half, n) == want


def test_a_published_run_is_not_trained_again(tmp_path):
    import json

    from flowcredit.commands.bench_skill import published as _published

    args = _skill_args("tp")
    cell = plan_cells(args, [])[0]
    assert not _published(tmp_path, cell, 10)
    (tmp_path / "skill-seed10.json").write_text(json.dumps({"summary": {"iterations": 200}, "heldout": {}}))
    assert not _published(tmp_path, cell, 10)  # cut short: not the whole run
    (tmp_path / "skill-seed10.json").write_text(json.dumps({"summary": {"iterations": 450}, "heldout": {}}))
    assert _published(tmp_path, cell, 10)


def test_a_published_run_must_have_trained_with_the_benchs_psi(tmp_path):
    """ψ calibrated again on a fresh machine: a published run with another ψ is an error naming both."""
    import json

    from flowcredit.commands.bench_skill import published as _published
    from flowcredit.errors import UserError

    psi_path = tmp_path / "psi.json"
    psi_path.write_text(json.dumps({"psi": [1.5, 0.75, 0.0]}))
    args = _skill_args("dense_euler1")
    cell = next(c for c in plan_cells(args, []) if c["name"] == "skill-dense_euler1")
    plain = dict(cell)
    cell = cell | {"overrides": cell["overrides"] + ["--calibrate", "false", "--psi_path", str(psi_path)]}
    record = {"summary": {"iterations": 450}, "heldout": {}, "calibration": {"psi": [1.5, 0.75, 0.0]}}
    (tmp_path / "skill-dense_euler1-seed10.json").write_text(json.dumps(record))
    assert _published(tmp_path, cell, 10)  # the same ψ
    record["calibration"]["psi"] = [1.5, 0.8, 0.0]
    (tmp_path / "skill-dense_euler1-seed10.json").write_text(json.dumps(record))
    with pytest.raises(UserError, match=r"skill-dense_euler1-seed10.json trained with ψ \[1.5, 0.8"):
        _published(tmp_path, cell, 10)
    assert _published(tmp_path, plain, 10)  # no ψ handed over: nothing to compare


def test_a_published_base_evaluation_is_not_recomputed(tmp_path):
    import json

    from flowcredit.commands.bench_skill import FINAL_EVAL_SAMPLES, FINAL_EVAL_SEEDS, base_published
    from flowcredit.tasks.prompt_sets import read_prompts

    assert not base_published(None, quick=False)
    assert not base_published(tmp_path, quick=False)
    whole = {"seeds": list(FINAL_EVAL_SEEDS), "sample_prompts": ["p"] * (86 * FINAL_EVAL_SAMPLES)}
    assert len(read_prompts("test")) == 86
    (tmp_path / "base-heldout.json").write_text(json.dumps({"heldout": whole}))
    assert base_published(tmp_path, quick=False)
    assert not base_published(tmp_path, quick=True)  # --quick evaluates its own small base
    (tmp_path / "base-heldout.json").write_text(json.dumps({"heldout": {**whole, "seeds": [7001]}}))
    assert not base_published(tmp_path, quick=False)
    cut = {**whole, "sample_prompts": ["p"] * (4 * FINAL_EVAL_SAMPLES)}  # --max-prompts 4
    (tmp_path / "base-heldout.json").write_text(json.dumps({"heldout": cut}))
    assert not base_published(tmp_path, quick=False)


def test_a_published_run_carries_its_training_curve(tmp_path):
    import json

    from flowcredit.commands.bench_skill import publish

    run = tmp_path / "skill-seed10"
    (run / "heldout").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"seed": 10}))
    (run / "heldout" / "eval.json").write_text(json.dumps({"tables": {}}))
    rows = [
        {"iteration": 0, "eval/test/soft": 0.5},  # an evaluation row: not a training step
        {"iteration": 1, "reward/mean": 0.25, "nfe/rollout": 960, "nfe/train": 960, "nfe/values": 0},
        {"iteration": 2, "reward/mean": 0.75, "nfe/rollout": 960, "nfe/train": 480, "nfe/values": 100},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = json.loads(publish(run, tmp_path / "pub").read_text())
    assert record["curve"] == {"iteration": [1, 2], "reward": [0.25, 0.75], "nfe": [1920, 3460]}
    assert record["config"] == {"seed": 10} and record["heldout"] == {"tables": {}}


def test_the_base_evaluation_runs_on_the_grids_device(tmp_path, monkeypatch):
    import subprocess
    from pathlib import Path

    from flowcredit.commands import bench_skill

    calls = []

    def fake_call(argv, **kw):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True)
        (out / "eval.json").write_text("{}")
        return 0

    monkeypatch.setattr(subprocess, "call", fake_call)
    cfg = load_config("skill", None, ["--device", "cuda:0"])
    assert bench_skill.base_eval(cfg, tmp_path / "base", threads=1) == tmp_path / "base" / "eval.json"
    argv = calls[0]
    assert argv[argv.index("--device") + 1] == "cuda:0" and argv[argv.index("--seeds") + 1] == "7001,7002"


@pytest.mark.parametrize(
    "diffs, want",
    [
        ([0.03, 0.04, 0.05, 0.04], "better"),  # 95 % interval above 0
        ([-0.03, -0.04, -0.05, -0.04], "worse"),
        # mean 0, sd 0.01: 90 % half-width 2.353 · 0.005 = 0.0118 < 0.02, 95 % spans 0
        ([0.01, -0.01, 0.01, -0.01], "equivalent"),
        ([0.03, -0.03, 0.03, -0.03], "inconclusive at n=4"),  # 90 % half-width 0.035 > 0.02
        ([0.5], "inconclusive at n=1"),
    ],
)
def test_arm_verdicts_by_hand(diffs, want):
    from flowcredit.commands.bench_skill import arm_verdict

    assert arm_verdict(diffs) == want


def test_equivalence_uses_the_90_percent_interval():
    """sd 0.0152 over 4 seeds (se 0.0076): the 90 % half-width (2.353 · 0.0076 = 0.0179) fits ±0.02
    around 0.0005, the 95 % one (3.182 · 0.0076 = 0.0242) would not."""
    from flowcredit.commands.bench_skill import arm_verdict

    diffs = [0.0005 + d for d in (0.0186, -0.0186, 0.0, 0.0)]
    sd = math.sqrt(2 * 0.0186**2 / 3)
    assert 2.3534 * sd / 2 < 0.02 - 0.0005 < 3.1825 * sd / 2
    assert arm_verdict(diffs) == "equivalent"


def test_run_cost_counts_training_and_calibration_calls_by_hand():
    """skill preset, dense credit with euler(1) values from the rollout (no value calls): a ψ
    calibration of 11 rounds = 11 × 4 groups × 12 trajectories × 10 rollout calls = 5,280."""
    import dataclasses

    from flowcredit.commands.bench_skill import run_cost
    from flowcredit.presets import load_config

    cfg = load_config("skill", None, ["--credit", "dense", "--sampler", "dance_sde", "--calibrate", "true"])
    cfg = dataclasses.replace(cfg, estimator="euler", substeps=1)
    record = {
        "config": dataclasses.asdict(cfg),
        "curve": {"iteration": [1, 2], "reward": [0.1, 0.2], "nfe": [1920, 3840]},
        "summary": {"minutes": 30.0},
        "calibration": {"iterations": 11},
    }
    cost = run_cost(record)
    assert cost["calibration_nfe"] == 11 * 4 * 12 * 10
    assert cost["train_nfe"] == 3840 and cost["nfe_per_iteration"] == 1920
    assert cost["cpu_minutes"] == 30.0 * cfg.threads
    assert run_cost({**record, "train_minutes": 45.0})["cpu_minutes"] == 45.0 * cfg.threads


def test_a_published_run_counts_the_minutes_of_every_iteration_across_resumes(tmp_path):
    """A run resumed at iteration 2 logged iteration 2 twice (60 s, then 30 s); the summary's 0.5
    minutes count only the process that finished it: 10 + 30 + 20 s = 1 minute."""
    import json

    from flowcredit.commands.bench_skill import publish

    run = tmp_path / "skill-seed10"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"seed": 10}))
    (run / "summary.json").write_text(json.dumps({"minutes": 0.5, "iterations": 3}))
    times = [(1, 10.0), (2, 60.0), (2, 30.0), (3, 20.0)]
    lines = [json.dumps({"iteration": i, "time/iteration_s": t}) + "\n" for i, t in times]
    (run / "timings.jsonl").write_text("".join(lines))
    record = json.loads(publish(run, tmp_path / "pub").read_text())
    assert record["train_minutes"] == 1.0


@pytest.mark.parametrize(
    "diffs, most, want",
    [
        # mean 0.02, sd 0.01414: "better" needs 0.02 > t(0.975, k−1) · 0.01414 / √k;
        # k = 4: 3.182 · 0.00707 = 0.0225 (not yet), k = 5: 2.776 · 0.00632 = 0.0176 (ends)
        ([0.01, 0.03], 40, 5),
        # mean 0, sd 0.00141: already equivalent at n = 2 (6.314 · 0.001 = 0.0063 < 0.02)
        ([0.001, -0.001], 40, 2),
        # mean 0.05, sd 0.0707: k = 10: 2.262 · 0.02236 = 0.0506 (not yet), k = 11: 2.228 · 0.02132 = 0.0475
        ([0.0, 0.1], 40, 11),
        ([0.0, 0.1], 10, None),  # beyond most
        ([0.5], 40, None),  # one seed: no SD
    ],
)
def test_seeds_for_verdict_by_hand(diffs, most, want):
    from flowcredit.commands.bench_skill_report import seeds_for_verdict

    assert seeds_for_verdict(diffs, most=most) == want
