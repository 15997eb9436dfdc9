"""What the skill report writes beside a verdict (flowcredit/commands/bench_skill_report.py,
``verdict_notes``), by hand: a verdict whose seeds spread less than the evaluation noise alone, and a
verdict of a rule committed after the arm's seeds landed; and the names its verdicts carry."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from flowcredit.commands.bench_skill_report import (
    ARM_NAMES,
    RULE_AFTER_SEEDS,
    SKILL_CLAIMS,
    arm_verdict,
    verdict_notes,
)

METRICS = ("overall", "per_image")


def _row(x: float) -> dict:
    return {"strict": {m: x for m in METRICS}}


def _report(diffs: dict[str, list[float]], jitter: float = 0.01) -> tuple[dict, dict]:
    """A report with Flow-GRPO (``skill``) at 0.3 on seeds 10, 11, … and each arm at 0.3 + its paired
    differences; each run's two noise seeds lie ±``jitter`` around its score, the arm's opposite to the
    baseline's, so every paired difference carries an evaluation noise of SD 2·``jitter`` exactly
    (per noise seed ∓2·jitter: variance (4·jitter)² / 2, halved by the mean of two)."""
    seeds = range(10, 10 + max(map(len, diffs.values())))
    rows = {"skill": {s: [_row(0.3 + jitter), _row(0.3 - jitter)] for s in seeds}}
    for arm, ds in diffs.items():
        rows[arm] = {s: [_row(0.3 + d - jitter), _row(0.3 + d + jitter)] for s, d in zip(seeds, ds)}
    per_seed = {
        a: {s: _row(sum(r["strict"]["overall"] for r in rs) / 2) for s, rs in v.items()}
        for a, v in rows.items()
    }
    paired = {
        arm: {"seeds": list(seeds)[: len(ds)], "verdict": {f"strict/{m}": arm_verdict(ds) for m in METRICS}}
        for arm, ds in diffs.items()
    }
    return {"arms": {a: {"per_seed": v} for a, v in per_seed.items()}, "paired": paired}, rows


def test_a_spread_below_the_evaluation_noise_is_unreliable():
    diffs = {
        "close": [-0.026, -0.025],  # worse at n = 2 (SD 0.0007, half-width 12.7 · 0.0005 = 0.006)
        "far": [-0.2, -0.2005],  # worse too, and still worse with SD 0.01 (half-width 0.09)
        "wide": [0.01, -0.03],  # inconclusive: nothing to say
    }
    out, rows = _report(diffs)
    verdict_notes(out, rows)
    assert out["evaluation_noise"]["strict/overall"] == pytest.approx(0.02, rel=1e-9)
    sds = [math.sqrt(sum((d - sum(ds) / 2) ** 2 for d in ds)) for ds in diffs.values()]
    assert out["pooled_sd"]["strict/overall"] == pytest.approx(math.sqrt(sum(s * s for s in sds) / 3))
    close, far, wide = (out["paired"][a] for a in diffs)
    assert close["verdict"]["strict/overall"] == far["verdict"]["strict/overall"] == "worse"
    assert set(close["notes"]["strict/overall"]) == {"unreliable"}
    chance = stats.chi2.cdf(sds[0] ** 2 / out["pooled_sd"]["strict/overall"] ** 2, 1)  # 0.0007 against 0.1
    label = close["label"]["strict/overall"]
    assert label.startswith(
        "worse, but n = 2 with a spread (SD 0.0007) below the evaluation noise alone (0.0200)"
    )
    assert "at that noise: inconclusive at n=2" in label and f"{100 * chance:.0f} % chance" in label
    assert far["notes"]["strict/overall"] == {} and far["label"]["strict/overall"] == "worse"
    assert wide["notes"]["strict/overall"] == {} and wide["label"]["strict/overall"].startswith(
        "inconclusive"
    )


def test_a_noise_below_the_spread_says_nothing():
    out, rows = _report({"close": [-0.026, -0.025]}, jitter=0.0001)  # noise SD 0.0002 < 0.0007
    verdict_notes(out, rows)
    assert out["paired"]["close"]["label"]["strict/overall"] == "worse"


def test_a_rule_committed_after_the_seeds_landed_is_said():
    out, rows = _report(
        {"skill-tp_equal_nfe": [-0.027, -0.015, -0.018, -0.047], "late": [0.001, -0.001, 0.0]}, jitter=0.0005
    )
    verdict_notes(out, rows, late={"skill-tp_equal_nfe": (10, 11, 12), "late": (10, 11, 12)})
    p = out["paired"]["skill-tp_equal_nfe"]
    assert p["label"]["strict/overall"] == (
        "worse (by the four-way rule committed on 2026-12-04 after 3 of its 4 seeds had landed)"
    )
    late = out["paired"]["late"]
    assert late["verdict"]["strict/overall"] == "equivalent"
    assert late["label"]["strict/overall"].endswith("after all 3 of its seeds had landed)")
    assert RULE_AFTER_SEEDS["skill-tp_equal_nfe"] == (10, 11, 12)  # 30f7152 at 09:08; seed 13 on 12-05


def test_dense_euler1_is_named_as_the_variant_it_is():
    claim = dict((arm, text) for arm, text, _ in SKILL_CLAIMS)
    for text in (claim["skill-dense_euler1"], ARM_NAMES["skill-dense_euler1"]):
        assert "one-step values and one shared ψ" in text and "not DenseGRPO as published" in text
    assert ARM_NAMES["skill-dense"] == "DenseGRPO" and claim["skill-dense"].startswith("DenseGRPO:")
