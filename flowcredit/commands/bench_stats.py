"""The statistics of ``flowcredit bench`` over the runs it read (``bench_read.read_run``); the tables and
plots that show them are ``flowcredit.commands.bench_report``.

Scores: ``test`` = held-out prompts (every task), ``train`` = the prompts trained on (logged when
the training set is small, as in the demo task). The *primary* score, on which "reach" and "at equal
seconds" are computed, is ``train`` when every run has it (the demo task: did the method learn what
it trained on?) and ``test`` otherwise.

Comparisons to Flow-GRPO are *paired*: the same seed gives every cell the same start model, data order
and evaluation noise, so ``paired_differences`` differences each cell's final point against the
Flow-GRPO run of the same seed, and ``claims`` turns those into verdicts on the papers' claims.
"""

from __future__ import annotations

import math
from functools import partial
from operator import itemgetter


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval (NaN for one value)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)


def mean_curve(runs: list[dict], key: str = "soft") -> list[dict]:
    """Seed-mean curve of ``key`` over the evaluation iterations that every seed reached."""
    common = set.intersection(*({p["iteration"] for p in r["points"]} for r in runs))
    out = []
    for it in sorted(common):
        pts = [next(p for p in r["points"] if p["iteration"] == it) for r in runs]
        out.append({k: sum(p[k] for p in pts) / len(pts) for k in ("iteration", "seconds", "nfe", key)})
    return out


def primary_key(results: dict) -> str:
    """``"train"`` when every run logged the trained-prompt score, else ``"soft"`` (held-out)."""
    runs = [r for rs in results.values() for r in rs]
    return "train" if runs and all("train" in r["points"][0] for r in runs) else "soft"


def _avg(runs: list[dict], f, k: int | None = None) -> float:
    """Seed mean of ``f(run)`` (its ``k``-th entry when given)."""
    return sum(f(r) if k is None else f(r)[k] for r in runs) / len(runs)


def summarise(cells: list[dict], results: dict) -> list[dict]:
    """One row per cell: final scores with CIs, reach of Flow-GRPO's final mean, equal-seconds score."""
    key = primary_key(results)
    fg = results.get("flow_grpo")
    target = ci95([r["points"][-1][key] for r in fg])[0] if fg else math.nan
    budget = _avg(fg, lambda r: r["points"][-1]["seconds"]) if fg else math.nan
    rows = []
    for cell in cells:
        runs = results[cell["name"]]
        avg = partial(_avg, runs)
        curve = mean_curve(runs, key)
        reach = next((p for p in curve if p[key] >= target), None)
        in_budget = [p for p in curve if p["seconds"] <= budget * 1.001]
        row = {"name": cell["name"], "seeds": len(runs), "iterations": avg(lambda r: r["iterations"])}
        for k in ("soft", "strict", "train"):
            if all(k in r["points"][-1] for r in runs):
                row[k] = ci95([r["points"][-1][k] for r in runs])
                row[f"{k}_start"] = sum(r["points"][0][k] for r in runs) / len(runs)
        row |= {
            "primary": key,
            "floor": avg(lambda r: r["noise_floor"]),
            "train_floor": avg(lambda r: r.get("train_floor", math.nan)),
            "reach_iteration": reach["iteration"] if reach else None,
            "reach_seconds": reach["seconds"] if reach else None,
            "at_flow_seconds": in_budget[-1][key] if in_budget else None,
            "at_flow_seconds_iteration": in_budget[-1]["iteration"] if in_budget else None,
            "nfe_per_iteration": [avg(itemgetter("nfe_per_iteration"), k) for k in range(3)],
            "s_per_iteration": avg(lambda r: r["seconds"]) / max(avg(lambda r: r["iterations"]), 1),
            "setup_seconds": avg(lambda r: r["setup_seconds"]),
            "target": target,
            "budget_seconds": budget,
            "categories": _final_categories(runs),
        }
        rows.append(row)
    return rows


BASELINE = "flow_grpo"


def _floor(run: dict, key: str) -> float:
    """The run's noise floor of ``key`` (std of its start score over 3 noise seeds)."""
    return run.get("train_floor", math.nan) if key == "train" else run.get("noise_floor", math.nan)


def _nfe(runs: list[dict]) -> float:
    """Seed-mean NFE per iteration, all phases together (rollout + values + update)."""
    return _avg(runs, lambda r: sum(r["nfe_per_iteration"])) if runs else math.nan


def _by_seed(runs: list[dict]) -> dict:
    return {r["seed"]: r for r in runs}


def paired_differences(results: dict, baseline: str = BASELINE) -> dict[str, dict]:
    """Per cell (in ``results`` order), over the cell's own seeds:

    - ``seeds``; ``gain[k]``: per-seed final − start of score ``k`` (``train`` when logged, ``soft``,
      ``strict``), in the order of ``seeds``;
    - ``heldout_change``: mean and 95 % half-width of held-out soft final − start;
      ``harm_seeds``: how many seeds fell by more than 2 × their run's ``noise_floor`` (a NaN floor
      counts as no harm);
    - ``nfe_per_iteration`` (seed mean, all phases) and ``nfe_ratio`` (÷ the baseline's).

    And for every cell but the baseline (when it is present), over the seeds that both ran (matched by
    ``run["seed"]``): ``n``, ``paired_seeds``, ``diff_per_seed[k]`` = the cell's final − the baseline's
    final of the same seed, and ``diff[k]`` = its mean and 95 % half-width (``ci95``; NaN for n = 1).
    """
    base = _by_seed(results.get(baseline, []))
    base_nfe = _nfe(list(base.values()))
    out = {}
    for name, runs in results.items():
        keys = [k for k in ("train", "soft", "strict") if all(k in r["points"][0] for r in runs)]
        change = [r["points"][-1]["soft"] - r["points"][0]["soft"] for r in runs]
        entry = {
            "seeds": [r.get("seed") for r in runs],
            "gain": {k: [r["points"][-1][k] - r["points"][0][k] for r in runs] for k in keys},
            "heldout_change": ci95(change) if runs else (math.nan, math.nan),
            "harm_seeds": sum(c < -2 * r["noise_floor"] for c, r in zip(change, runs)),
            "nfe_per_iteration": _nfe(runs),
            "nfe_ratio": _nfe(runs) / base_nfe if base_nfe else math.nan,
        }
        if base and name != baseline:
            pairs = [(r, base[r["seed"]]) for r in runs if r["seed"] in base]
            keys = [k for k in keys if all(k in b["points"][-1] for _, b in pairs)]
            per_seed = {k: [r["points"][-1][k] - b["points"][-1][k] for r, b in pairs] for k in keys}
            entry |= {"n": len(pairs), "paired_seeds": [r["seed"] for r, _ in pairs]}
            entry |= {"diff_per_seed": per_seed, "diff": {k: ci95(v) for k, v in per_seed.items() if v}}
        out[name] = entry
    return out


# (cell-name prefix, claim, rule): ("reach", mean_max, bound) or ("better", equivalence half-width)
CLAIMS = (
    ("tp_grpo", "TP-GRPO reaches Flow-GRPO's final score in ≈ 1/3 of the iterations", ("reach", 0.4, 0.5)),
    ("stepwise_grpo", "Stepwise: 2–3× fewer iterations to reach Flow-GRPO's final", ("reach", 0.5, 0.67)),
    ("dense_grpo", "DenseGRPO: better final reward than Flow-GRPO", ("better", 0.03)),
)


def verdict(rule: tuple, mean: float, half: float, n: int, never: int = 0) -> str:
    """The verdict rules, all in one place. ``n`` = seeds paired with Flow-GRPO; below 2 seeds (no
    interval) every claim is ``"inconclusive at n=<n>"``.

    ``("reach", mean_max, bound)``: ``mean ± half`` is the seed-mean ratio (first evaluated iteration
    where the cell's primary score ≥ the same seed's Flow-GRPO final) ÷ (that Flow-GRPO run's final
    iteration); a seed that never reaches it counts with its last evaluated iteration, a lower bound
    of its true ratio (``never`` of them).

    - ``"reproduced"``: every seed reached it, the mean ≤ ``mean_max`` and the upper bound ≤ ``bound``
      (TP-GRPO: 0.4 / 0.5, i.e. ≈ 1/3; Stepwise: 0.5 / 0.67, i.e. 2–3× fewer iterations);
    - ``"not reproduced"``: most seeds never reach it, or the lower bound > ``bound`` (the censored
      seeds only lower the mean, so this holds with them);
    - else ``"inconclusive at n=<n>"``.

    ``("better", eq)``: ``mean ± half`` = paired difference cell − Flow-GRPO of the final primary score.

    - ``"reproduced"``: lower bound > 0 (better);
    - ``"not reproduced"``: upper bound < 0 (worse), or the interval contains 0 and ``half`` ≤ ``eq``
      (no difference larger than ±``half``: equivalent at this resolution);
    - else ``"inconclusive at n=<n>"`` (the interval contains 0 but is too wide to exclude a gain).
    """
    inconclusive = f"inconclusive at n={n}"
    if n < 2 or not math.isfinite(half):
        return inconclusive
    lo, hi = mean - half, mean + half
    if rule[0] == "reach":
        _, mean_max, bound = rule
        if never > n / 2 or lo > bound:
            return "not reproduced"
        return "reproduced" if never == 0 and mean <= mean_max and hi <= bound else inconclusive
    if lo > 0:
        return "reproduced"
    return "not reproduced" if hi < 0 or half <= rule[1] else inconclusive


def _reach_claim(runs: list[dict], base: dict, key: str, rule: tuple) -> tuple[str, str]:
    """Verdict and evidence of a "reach Flow-GRPO's final in fewer iterations" claim."""
    pairs = [(r, base[r["seed"]]) for r in runs if r["seed"] in base]
    ratios, never, shown = [], 0, []
    for r, b in pairs:
        target, total = b["points"][-1][key], b["points"][-1]["iteration"]
        hit = next((p["iteration"] for p in r["points"] if p[key] >= target), None)
        never += hit is None
        it = r["points"][-1]["iteration"] if hit is None else hit
        ratios.append(it / max(total, 1))
        shown.append(f"{'never' if hit is None else hit}/{total}")
    n = len(pairs)
    if not n:
        return f"inconclusive at n={n}", "no seed in common with Flow-GRPO"
    mean, half = ci95(ratios)
    gain = [b["points"][-1][key] - b["points"][0][key] for _, b in pairs]
    floor = sum(_floor(b, key) for _, b in pairs) / n
    evidence = (
        f"iterations to reach Flow-GRPO's final {key} (same seed) / its iterations: {', '.join(shown)}; "
        f"ratio {plus_minus((mean, half))}, never = at its last evaluation (reproduced: mean ≤ {rule[1]} "
        f"and upper ≤ {rule[2]}; not reproduced: lower > {rule[2]} or most never)"
    )
    if sum(gain) / n <= 2 * floor:  # NaN floor: no guard
        return f"inconclusive at n={n}", (
            f"Flow-GRPO's {key} gained {sum(gain) / n:+.3f} ≤ 2 × noise floor ({floor:.3f}): "
            "nothing to reach; " + evidence
        )
    return verdict(rule, mean, half, n, never), evidence


def claims(results: dict, rows: list[dict] | None = None) -> list[dict]:
    """Verdicts ``{claim, cell, verdict, evidence}`` on the papers' claims (``CLAIMS``, judged by
    ``verdict``) for every cell whose name starts with a claim's prefix, against Flow-GRPO of the same
    seeds, on the primary score (``rows[0]["primary"]`` when given, else ``primary_key``). A reach claim
    is ``inconclusive`` also when Flow-GRPO's seed-mean gain (final − start) is ≤ 2 × its noise floor:
    then its final is no target worth reaching. Empty without a Flow-GRPO cell."""
    base = _by_seed(results.get(BASELINE, []))
    if not base:
        return []
    key = rows[0]["primary"] if rows else primary_key(results)
    names = [r["name"] for r in rows] if rows else list(results)
    paired = paired_differences(results)
    out = []
    for name in names:
        for prefix, claim, rule in CLAIMS:
            if not name.startswith(prefix):
                continue
            if rule[0] == "reach":
                verdict_, evidence = _reach_claim(results[name], base, key, rule)
            else:
                p = paired[name]
                mean, half = p["diff"].get(key, (math.nan, math.nan))
                verdict_ = verdict(rule, mean, half, p["n"])
                evidence = f"Δ final {key} (paired, n={p['n']}) = {plus_minus((mean, half), '+')}"
                if verdict_ == "not reproduced" and mean + half >= 0:
                    evidence = f"no difference larger than ±{half:.3f}: " + evidence
            out.append({"claim": claim, "cell": name, "verdict": verdict_, "evidence": evidence})
    return out


def ablation_differences(results: dict) -> dict[str, dict]:
    """For every variant cell ``"<preset>-<variant>"`` whose preset cell ran too: its
    :func:`paired_differences` entry against that preset (same seeds), not against Flow-GRPO."""
    out = {}
    for name in results:
        base = name.split("-")[0]
        if base != name and base in results:
            out[name] = paired_differences({base: results[base], name: results[name]}, base)[name]
    return out


def report(cells: list[dict], results: dict) -> dict:
    """Everything ``bench`` stores: ``table`` (``summarise``), ``paired``, ``variants`` (each variant
    against its own preset) and ``claims``."""
    rows = summarise(cells, results)
    paired, variants = paired_differences(results), ablation_differences(results)
    return {"table": rows, "paired": paired, "variants": variants, "claims": claims(results, rows)}


def plus_minus(mean_half: tuple[float, float] | None, sign: str = "") -> str:
    """``"+0.012 ± 0.020"`` (``sign="+"`` shows the sign); "—" for None; "(one seed)" for a NaN half."""
    if mean_half is None:
        return "—"
    mean, half = mean_half
    return f"{mean:{sign}.3f} ± {half:.3f}" if math.isfinite(half) else f"{mean:{sign}.3f} (one seed)"


def _final_categories(runs: list[dict]) -> dict[str, list[float]]:
    """Held-out per-category final soft score: ``{category: [start mean, final mean]}`` over seeds."""
    cats = set.intersection(*(set(r.get("categories_final", {})) for r in runs)) if runs else set()
    return {
        c: [sum(r[f"categories_{when}"][c] for r in runs) / len(runs) for when in ("start", "final")]
        for c in sorted(cats)
    }
