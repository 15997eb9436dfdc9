"""The ``skill`` comparison's report (``flowcredit bench --task skill``,
``benchmarks/skill_grid/skill_grid_report.py``): held-out scores of the published runs
(:func:`flowcredit.commands.bench_skill.publish`), paired differences to Flow-GRPO and the verdicts on
the papers' claims. Re-exported by :mod:`flowcredit.commands.bench_skill`, which holds the arms, their
network-call costs and the runs' final evaluation.
"""

from __future__ import annotations

import math

SKILL_CLAIMS = (
    ("skill-tp", "TP-GRPO: better held-out GenEval-style score than Flow-GRPO (same iterations)", "better"),
    (
        "skill-tp_equal_nfe",
        "TP-GRPO reaches Flow-GRPO's score at ≈ 1/3 of its steps (equal NFE)",
        "noninferior",
    ),
    (
        "skill-dense_euler1",
        "DenseGRPO with one-step values and one shared ψ (not DenseGRPO as published): better than Flow-GRPO",
        "better",
    ),
    ("skill-dense", "DenseGRPO: better than Flow-GRPO", "better"),
    ("skill-stepwise", "Stepwise-Flow-GRPO: better than Flow-GRPO", "better"),
    ("skill-mixgrpo", "MixGRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-tempflow", "TempFlow-GRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-egrpo", "E-GRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-grpo_guard", "GRPO-Guard: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    (
        "skill-nft_quarter",
        "DiffusionNFT reaches Flow-GRPO's score with 1/4 of its network calls",
        "noninferior",
    ),
    ("skill-awm_quarter", "AWM reaches Flow-GRPO's score with 1/4 of its network calls", "noninferior"),
    ("skill-coca", "CoCA: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-flash", "Flash-GRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-tree", "TreeGRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-branch", "BranchGRPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-dgpo_quarter", "DGPO reaches Flow-GRPO's score with 1/4 of its network calls", "noninferior"),
    ("skill-g2rpo", "G²RPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
    ("skill-dppo", "Flow-DPPO: at least as good as Flow-GRPO at equal network calls", "noninferior"),
)
"""(arm, the paper's claim as this grid can test it, rule of :func:`skill_verdict`)."""
EQUIVALENCE = 0.02
"""Held-out strict: a difference within ±0.02 counts as none (the rule of ``"better"``), and TP-GRPO at
equal NFE is non-inferior if it is at most 0.02 below Flow-GRPO."""
ARM_NAMES = {
    "skill": "Flow-GRPO",
    "skill-tp": "TP-GRPO, same iterations",
    "skill-tp_equal_nfe": "TP-GRPO at Flow-GRPO's network calls",
    "skill-dense_euler1": "DenseGRPO with one-step values and one shared ψ (not DenseGRPO as published)",
    "skill-dense": "DenseGRPO",
    "skill-dense_euler1_cps": "diagnostic: dense_euler1's credit rule on CPS",
    "skill-dance_psi": "diagnostic: dense_euler1's sampler (Dance-SDE, shared ψ), Flow-GRPO's credit",
    "skill-stepwise": "Stepwise-Flow-GRPO",
    "skill-stepwise_cps": "Stepwise-Flow-GRPO's credit rule on CPS",
    "skill-mixgrpo": "MixGRPO",
    "skill-tempflow": "TempFlow-GRPO",
    "skill-egrpo": "E-GRPO",
    "skill-grpo_guard": "GRPO-Guard",
    "skill-nft_quarter": "DiffusionNFT at 1/4 of the network calls",
    "skill-awm_quarter": "AWM at 1/4 of the network calls",
    "skill-coca": "CoCA",
    "skill-flash": "Flash-GRPO",
    "skill-tree": "TreeGRPO",
    "skill-branch": "BranchGRPO",
    "skill-dgpo_quarter": "DGPO at 1/4 of the network calls",
    "skill-g2rpo": "G²RPO",
    "skill-dppo": "Flow-DPPO",
}
"""What each arm is, as its verdicts name it: ``dense_euler1`` is a variant (one-step values, one ψ
calibrated once and shared by every seed: bench.shared_psi), so "DenseGRPO" alone names ``dense``."""
RULE_AFTER_SEEDS = {"skill-tp": (10, 11, 12, 13), "skill-tp_equal_nfe": (10, 11, 12)}
"""Per arm, the seeds that had landed before :func:`arm_verdict`'s four-way rule was committed
(30f7152, 2026-12-04): its better / worse / equivalent verdicts were read by a rule chosen after those
seeds were seen (:func:`verdict_notes`)."""


FIXES = (
    (
        "819b3bc",
        "2026-12-06T01:13:31Z",
        ("awm", "nft"),
        "AWM and DiffusionNFT dropped the groups whose advantages were all zero (issue 53)",
    ),
)
"""(fixing commit, its UTC time, the update rules it changed, what a run before it did): fixes that
change what a published run of those rules trained. A run predates a fix (:func:`fixes_missed`) until
it is rerun: the report marks its arm, so its numbers are not read as the rule's as it is now."""


def fixes_missed(record: dict) -> list[str]:
    """The commits of :data:`FIXES` that a published run ran without: its update rule (``config.update``)
    is one the fix changed, and not every start or resume of it (``provenance``, each with its UTC
    ``time``; recorded since 2026-12-06) came after the fix. A run without provenance predates them."""
    rule = record.get("config", {}).get("update")
    starts = [str(p.get("time") or "") for p in record.get("provenance", [])]
    return [commit for commit, at, rules, _ in FIXES if rule in rules and (not starts or min(starts) < at)]


VERDICT_METRICS = ("strict/overall", "strict/per_image")
"""The pre-registered metrics of :func:`arm_verdict` (docs/benchmarks.md, written 2026-12-04 before the
first DenseGRPO or Stepwise run landed): held-out strict as GenEval averages it (the mean of the
category means; primary) and per image."""


def arm_verdict(diffs: list[float], margin: float = EQUIVALENCE) -> str:
    """An arm against Flow-GRPO from its paired differences (arm − Flow-GRPO, one per seed):

    - ``"better"``: the 95 % t-interval lies above 0; ``"worse"``: below 0;
    - ``"equivalent"``: otherwise, if the 90 % t-interval lies inside ±``margin`` (two one-sided
      tests at 5 % each);
    - ``"inconclusive at n=<n>"``: neither (and always below 2 seeds).
    """
    n = len(diffs)
    if n < 2:
        return f"inconclusive at n={n}"
    return _verdict(*_mean_sd(diffs), n, margin)


def _mean_sd(values: list[float]) -> tuple[float, float]:
    """The mean and the sample SD (n − 1) of at least two values."""
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _verdict(mean: float, sd: float, n: int, margin: float) -> str:
    """:func:`arm_verdict`'s rule from the mean, the sample SD and the number of seeds (n ≥ 2)."""
    from scipy import stats

    half95, half90 = (stats.t.ppf(q, n - 1) * sd / math.sqrt(n) for q in (0.975, 0.95))
    if mean - half95 > 0:
        return "better"
    if mean + half95 < 0:
        return "worse"
    if -margin < mean - half90 and mean + half90 < margin:
        return "equivalent"
    return f"inconclusive at n={n}"


def seeds_for_verdict(diffs: list[float], margin: float = EQUIVALENCE, most: int = 40) -> int | None:
    """The fewest paired seeds at which :func:`arm_verdict` would end (better, worse or equivalent) if
    more seeds kept these differences' mean and sample SD: a planning figure, not a result (the next
    seeds move both). ``len(diffs)`` when the verdict has ended already; None beyond ``most`` seeds, or
    below 2 (no SD yet)."""
    n = len(diffs)
    if n < 2:
        return None
    mean, sd = _mean_sd(diffs)
    ended = (k for k in range(n, most + 1) if not _verdict(mean, sd, k, margin).startswith("inconclusive"))
    return next(ended, None)


def seed_rows(heldout: dict, categories: dict[str, str]) -> list[dict]:
    """Per noise seed of one evaluation file (``flowcredit eval`` JSON): ``{"strict", "soft"}`` →
    ``{"overall", "per_image", <category>...}``; overall = the mean of the category means (GenEval's
    convention), per_image = the mean over all images."""
    cats = [categories[p] for p in heldout["sample_prompts"]]
    rows = []
    for seed in map(str, heldout["seeds"]):
        row = {}
        for key in ("strict", "soft"):
            values = heldout["per_sample"][seed][key]
            by_cat = {c: [v for v, cc in zip(values, cats) if cc == c] for c in dict.fromkeys(cats)}
            row[key] = {c: sum(v) / len(v) for c, v in by_cat.items()}
            row[key]["overall"] = sum(row[key].values()) / len(row[key])
            row[key]["per_image"] = sum(values) / len(values)
        rows.append(row)
    return rows


def heldout_scores(heldout: dict, categories: dict[str, str]) -> dict:
    """:func:`seed_rows` averaged over the noise seeds."""
    return _mean_of(seed_rows(heldout, categories))


def _mean_of(rows: list[dict]) -> dict:
    return {
        key: {k: sum(r[key][k] for r in rows) / len(rows) for k in rows[0][key]} for key in ("strict", "soft")
    }


def verdict_notes(out: dict, rows: dict, baseline: str = "skill", late: dict | None = None) -> None:
    """Adds to ``out`` (:func:`skill_report`'s) what a verdict must say beside the rule's word, per
    metric of :data:`VERDICT_METRICS`: ``evaluation_noise`` (the SD of one paired difference that the
    noise seeds' disagreement alone predicts, pooled over the table's paired runs: ``rows[arm][seed]``
    holds :func:`seed_rows`), ``pooled_sd`` (of the paired differences over the arms, by their
    degrees of freedom), and per paired arm ``notes`` (``{tag: text}``) and ``label`` (the verdict
    with its notes). Tags: ``"unreliable"``, a better / worse / equivalent whose paired differences
    spread less than the evaluation noise alone and that the noise as their SD would change, with the
    chance of a spread this small under the pooled SD (χ², n − 1 degrees of freedom);
    ``"rule_after_seeds"``, a verdict of the four-way rule committed after some of the arm's seeds had
    landed (``late``: :data:`RULE_AFTER_SEEDS` for the held-out set)."""
    paired, per_seed = out["paired"], {a: v["per_seed"] for a, v in out["arms"].items()}
    for metric in VERDICT_METRICS:
        key, part = metric.split("/")
        diffs = {
            a: [per_seed[a][s][key][part] - per_seed[baseline][s][key][part] for s in p["seeds"]]
            for a, p in paired.items()
        }
        noise = []  # per paired run: the variance of its difference's mean over the noise seeds
        for a, p in paired.items():
            for s in p["seeds"]:
                d = [x[key][part] - y[key][part] for x, y in zip(rows[a][s], rows[baseline][s])]
                noise += [_mean_sd(d)[1] ** 2 / len(d)] if len(d) > 1 else []
        spread = [(len(d) - 1, _mean_sd(d)[1]) for d in diffs.values() if len(d) > 1]
        noise_sd = math.sqrt(sum(noise) / len(noise)) if noise else float("nan")
        dof = sum(k for k, _ in spread)
        pooled = math.sqrt(sum(k * sd**2 for k, sd in spread) / dof) if dof else float("nan")
        out.setdefault("evaluation_noise", {})[metric] = noise_sd
        out.setdefault("pooled_sd", {})[metric] = pooled
        for arm, p in paired.items():
            landed = tuple(s for s in (late or {}).get(arm, ()) if s in p["seeds"])
            notes = _notes(p["verdict"][metric], diffs[arm], noise_sd, pooled, landed)
            p.setdefault("notes", {})[metric] = notes
            label = p["verdict"][metric] + (f", but {notes['unreliable']}" if "unreliable" in notes else "")
            p.setdefault("label", {})[metric] = label + (
                f" ({notes['rule_after_seeds']})" if "rule_after_seeds" in notes else ""
            )


def _notes(verdict: str, diffs: list[float], noise: float, pooled: float, landed: tuple) -> dict[str, str]:
    """:func:`verdict_notes`'s notes on one arm's verdict from its paired differences."""
    notes, n = {}, len(diffs)
    if verdict.startswith("inconclusive"):
        return notes
    mean, sd = _mean_sd(diffs)
    at_noise = _verdict(mean, noise, n, EQUIVALENCE) if noise == noise else verdict
    if sd < noise and at_noise != verdict:
        from scipy import stats

        chance = stats.chi2.cdf((n - 1) * sd**2 / pooled**2, n - 1)
        notes["unreliable"] = (
            f"n = {n} with a spread (SD {sd:.4f}) below the evaluation noise alone ({noise:.4f}): unreliable "
            f"(at that noise: {at_noise}; a spread this small: {100 * chance:.0f} % chance under the pooled "
            f"SD {pooled:.3f})"
        )
    if landed:
        which = f"all {n} of its" if len(landed) == n else f"{len(landed)} of its {n}"
        notes["rule_after_seeds"] = (
            f"by the four-way rule committed on 2026-12-04 after {which} seeds had landed"
        )
    return notes


def skill_verdict(rule: str, mean: float, half: float, n: int) -> str:
    """``"better"``: the rule of :func:`flowcredit.commands.bench_stats.verdict` with ±``EQUIVALENCE``;
    ``"noninferior"``: reproduced if the lower bound > −EQUIVALENCE, not reproduced if the upper
    bound < −EQUIVALENCE, else inconclusive; below 2 paired seeds always inconclusive."""
    from flowcredit.commands.bench_stats import verdict

    if rule == "better":
        return verdict(("better", EQUIVALENCE), mean, half, n)
    if n < 2 or half != half:
        return f"inconclusive at n={n}"
    if mean - half > -EQUIVALENCE:
        return "reproduced"
    return "not reproduced" if mean + half < -EQUIVALENCE else f"inconclusive at n={n}"


def skill_report(
    records: dict[str, dict], categories: dict[str, str], baseline: str = "skill", evaluation: str = "heldout"
) -> dict:
    """From published records (``name -> publish()`` JSON; the base evaluation under ``base-heldout``,
    runs as ``<arm>-seed<k>``): per arm the seeds, mean scores and change from the base; paired
    differences arm − baseline per seed with 95 % t-intervals (overall, per image, per category);
    verdicts per claim, and what each verdict's label must say (:func:`verdict_notes`). ``evaluation``:
    the records' evaluation read, ``"heldout"`` or the confirmation set's ``"confirm"`` (``categories``:
    its prompts')."""
    from flowcredit.commands.bench_stats import ci95

    base = heldout_scores(records["base-heldout"][evaluation], categories)
    arms: dict[str, dict[int, dict]] = {}
    rows: dict[str, dict[int, list[dict]]] = {}  # arm → seed → the evaluation per noise seed
    before: dict[str, dict[str, list[int]]] = {}  # arm → {fixing commit: seeds run before it}
    for name, rec in sorted(records.items()):
        arm, _, seed = name.rpartition("-seed")
        if arm and seed.isdigit() and evaluation in rec:
            rows.setdefault(arm, {})[int(seed)] = seed_rows(rec[evaluation], categories)
            arms.setdefault(arm, {})[int(seed)] = _mean_of(rows[arm][int(seed)])
            for commit in fixes_missed(rec):
                before.setdefault(arm, {}).setdefault(commit, []).append(int(seed))
    out = {"base": base, "arms": {}, "paired": {}, "claims": []}
    for arm, by_seed in sorted(arms.items()):
        change = {k: ci95([s[k]["overall"] - base[k]["overall"] for s in by_seed.values()]) for k in base}
        parts = {
            f"{k}/{p}": ci95([s[k][p] - base[k][p] for s in by_seed.values()]) for k in base for p in base[k]
        }
        out["arms"][arm] = {"seeds": sorted(by_seed), "per_seed": by_seed, "change_from_base": change}
        out["arms"][arm]["change_by_part"] = parts  # "strict/<category>", "soft/per_image", …
        out["arms"][arm]["before_fix"] = {c: sorted(v) for c, v in before.get(arm, {}).items()}
    for arm, by_seed in sorted(arms.items()):
        if arm == baseline or baseline not in arms:
            continue
        seeds = sorted(set(by_seed) & set(arms[baseline]))
        if not seeds:
            continue
        diffs, verdicts, needed = {}, {}, {}
        for key in ("strict", "soft"):
            for part in base[key]:
                values = [by_seed[s][key][part] - arms[baseline][s][key][part] for s in seeds]
                diffs[f"{key}/{part}"] = ci95(values)
                if f"{key}/{part}" in VERDICT_METRICS:
                    verdicts[f"{key}/{part}"] = arm_verdict(values)
                    needed[f"{key}/{part}"] = seeds_for_verdict(values)
        out["paired"][arm] = {"seeds": seeds, "diff": diffs, "verdict": verdicts, "seeds_for_verdict": needed}
        out["paired"][arm]["before_fix"] = out["arms"][arm]["before_fix"]
    verdict_notes(out, rows, baseline, RULE_AFTER_SEEDS if evaluation == "heldout" else {})
    for arm, claim, rule in SKILL_CLAIMS:
        if arm in out["paired"]:
            p = out["paired"][arm]
            mean, half = p["diff"]["strict/overall"]
            status = skill_verdict(rule, mean, half, len(p["seeds"]))
            out["claims"].append({"arm": arm, "claim": claim, "n": len(p["seeds"]), "verdict": status})
    return out
