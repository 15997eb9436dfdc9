"""The tables and plots of ``flowcredit bench`` from the runs it read (``bench.read_run``).

Scores: ``test`` = held-out prompts (every task), ``train`` = the prompts trained on (logged when
the training set is small, as in the demo task). The *primary* score, on which "reach" and "at equal
seconds" are computed, is ``train`` when every run has it (the demo task: did the method learn what
it trained on?) and ``test`` otherwise.
"""

from __future__ import annotations

import math
from functools import partial
from operator import itemgetter
from pathlib import Path


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


def _final_categories(runs: list[dict]) -> dict[str, list[float]]:
    """Held-out per-category final soft score: ``{category: [start mean, final mean]}`` over seeds."""
    cats = set.intersection(*(set(r.get("categories_final", {})) for r in runs)) if runs else set()
    return {
        c: [sum(r[f"categories_{when}"][c] for r in runs) / len(runs) for when in ("start", "final")]
        for c in sorted(cats)
    }


def _pm(mean_half: tuple[float, float] | None) -> str:
    if mean_half is None:
        return "—"
    mean, half = mean_half
    return f"{mean:.3f} ± {half:.3f}" if math.isfinite(half) else f"{mean:.3f} (one seed)"


def _opt(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def write_table(out: Path, rows: list[dict], settings: dict) -> None:
    r0 = rows[0] if rows else {}
    key = r0.get("primary", "soft")
    label = "trained prompts" if key == "train" else "held-out"
    lines = [
        "# flowcredit bench",
        "",
        f"Settings: `{settings}`",
        "",
        "ShapeEval soft/strict scores (ODE sampler, fixed noise); final = mean ± 95 % t-interval over seeds. "
        f"Primary score: {label}. Reach = first evaluation where the seed-mean primary score ≥ Flow-GRPO's "
        f"final mean ({r0.get('target', math.nan):.3f}), — if never. At equal seconds = the seed-mean "
        f"primary score at the last evaluation within Flow-GRPO's mean wall clock "
        f"({r0.get('budget_seconds', math.nan):.0f} s; its iteration in brackets). Noise floor = std of "
        "the start score over 3 noise seeds. Seconds include evaluation; set-up (model load, ψ "
        "calibration, start evaluation) is apart. NFE = sample·forward passes (CFG counts twice): "
        "rollout + values + update.",
        "",
        "| method | seeds | trained prompts: start → final | floor | held-out soft: start → final | floor "
        "| held-out strict (final) | reach: it / s | at equal seconds | NFE / it (rollout+values+update) "
        "| s / it | set-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        nfe = r["nfe_per_iteration"]
        nfe_s = f"{sum(nfe):,.0f} ({nfe[0]:,.0f}+{nfe[1]:,.0f}+{nfe[2]:,.0f})"
        train = f"{r['train_start']:.3f} → {_pm(r['train'])}" if "train" in r else "—"
        equal = f"{_opt(r['at_flow_seconds'], '.3f')} ({_opt(r['at_flow_seconds_iteration'], '.0f')})"
        lines.append(
            f"| {r['name']} | {r['seeds']} | {train} | ±{r['train_floor']:.3f} | {r['soft_start']:.3f} → "
            f"{_pm(r['soft'])} | ±{r['floor']:.3f} | {_pm(r['strict'])} "
            f"| {_opt(r['reach_iteration'], '.0f')} / {_opt(r['reach_seconds'], '.0f')} | {equal} | {nfe_s} "
            f"| {r['s_per_iteration']:.1f} | {r['setup_seconds']:.0f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")


def write_plots(out: Path, cells: list[dict], results: dict, rows: list[dict]) -> None:
    """Primary score vs iteration, seconds and NFE (thin lines per seed, thick seed mean), and the
    held-out per-category bars (start vs final, seed means)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = primary_key(results)
    target = rows[0]["target"] if rows else math.nan
    ylabel = ("trained prompts" if key == "train" else "held-out") + " soft score (ODE, fixed noise)"
    labels = {"iteration": "iteration", "seconds": "wall-clock seconds", "nfe": "model calls (NFE)"}
    for x, xlabel in labels.items():
        fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110)
        for k, cell in enumerate(cells):
            color = f"C{k % 10}"
            for pts in [r["points"] for r in results[cell["name"]]]:  # each seed, thin
                ax.plot([p[x] for p in pts], [p[key] for p in pts], color=color, alpha=0.25, lw=0.8)
            pts = mean_curve(results[cell["name"]], key)
            ax.plot([p[x] for p in pts], [p[key] for p in pts], "o-", color=color, label=cell["name"])
        if math.isfinite(target):
            ax.axhline(target, color="gray", ls="--", lw=0.8, label="Flow-GRPO final mean")
        ax.set(xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"reward_vs_{x}.png")
        plt.close(fig)
    _category_bars(out, rows, plt)


def _category_bars(out: Path, rows: list[dict], plt) -> None:
    cats = sorted(set.intersection(*(set(r["categories"]) for r in rows))) if rows else []
    if not cats:
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=110)
    width = 0.8 / (len(rows) + 1)
    start = [rows[0]["categories"][c][0] for c in cats]
    ax.bar([i for i in range(len(cats))], start, width, color="lightgray", label="start")
    for k, r in enumerate(rows):
        xs = [i + (k + 1) * width for i in range(len(cats))]
        ax.bar(xs, [r["categories"][c][1] for c in cats], width, color=f"C{k % 10}", label=r["name"])
    ax.set_xticks([i + len(rows) * width / 2 for i in range(len(cats))], cats, fontsize=7)
    ax.set(ylabel="held-out soft score, final (seed mean)")
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "categories.png")
    plt.close(fig)
