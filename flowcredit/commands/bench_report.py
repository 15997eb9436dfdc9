"""The tables (``table.md``) and plots of ``flowcredit bench``, from the statistics of
``flowcredit.commands.bench_stats``."""

from __future__ import annotations

import math
from pathlib import Path

from flowcredit.commands.bench_stats import (
    BASELINE,
    ablation_differences,
    claims,
    mean_curve,
    paired_differences,
    plus_minus,
    primary_key,
    report,
)

__all__ = ["report", "write_plots", "write_table"]


def _opt(value, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def write_table(out: Path, rows: list[dict], settings: dict, results: dict | None = None) -> None:
    """OUT/table.md: the summary rows, then, given ``results`` with a Flow-GRPO cell of ≥ 2 seeds, the
    paired differences to it and the verdicts on the papers' claims."""
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
        train = f"{r['train_start']:.3f} → {plus_minus(r['train'])}" if "train" in r else "—"
        equal = f"{_opt(r['at_flow_seconds'], '.3f')} ({_opt(r['at_flow_seconds_iteration'], '.0f')})"
        lines.append(
            f"| {r['name']} | {r['seeds']} | {train} | ±{r['train_floor']:.3f} | {r['soft_start']:.3f} → "
            f"{plus_minus(r['soft'])} | ±{r['floor']:.3f} | {plus_minus(r['strict'])} "
            f"| {_opt(r['reach_iteration'], '.0f')} / {_opt(r['reach_seconds'], '.0f')} | {equal} | {nfe_s} "
            f"| {r['s_per_iteration']:.1f} | {r['setup_seconds']:.0f} |"
        )
    if results and len(results.get(BASELINE, [])) >= 2:
        lines += _paired_lines(results, rows)
    (out / "table.md").write_text("\n".join(lines) + "\n")


def _paired_lines(results: dict, rows: list[dict]) -> list[str]:
    paired = paired_differences(results)
    lines = [
        "",
        "### Paired difference to Flow-GRPO (same seeds, 95 % t-interval)",
        "",
        "Δ = the cell's final − Flow-GRPO's final of the same seed, mean ± 95 % t-interval over the n "
        "seeds both ran. Held-out change = held-out soft final − start (all the cell's seeds); harm = a "
        "fall of more than 2 × the run's noise floor.",
        "",
        "| cell | n | Δ trained | Δ held-out soft | Δ held-out strict | held-out change (final − start) "
        "| seeds with held-out harm > 2×floor | NFE/it | NFE/it ÷ Flow-GRPO's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, p in paired.items():
        diff = p.get("diff", {})
        delta = [plus_minus(diff[k], "+") if k in diff else "—" for k in ("train", "soft", "strict")]
        lines.append(
            f"| {name} | {p.get('n', len(p['seeds']))} | {' | '.join(delta)} "
            f"| {plus_minus(p['heldout_change'], '+')} | {p['harm_seeds']} / {len(p['seeds'])} "
            f"| {p['nfe_per_iteration']:,.0f} | {p['nfe_ratio']:.2f}× |"
        )
    variants = ablation_differences(results)
    if variants:
        lines += [
            "",
            "### Variants against their own preset (same seeds, 95 % t-interval)",
            "",
            "| variant | n | Δ trained | Δ held-out soft | Δ held-out strict |",
            "|---|---|---|---|---|",
        ]
        for name, p in variants.items():
            diff = p.get("diff", {})
            delta = [plus_minus(diff[k], "+") if k in diff else "—" for k in ("train", "soft", "strict")]
            lines.append(f"| {name} | {p.get('n', 0)} | {' | '.join(delta)} |")
    verdicts = claims(results, rows)
    lines += ["", "### Paper claims", ""]
    lines += [f"- **{c['claim']}** ({c['cell']}): **{c['verdict']}**. {c['evidence']}." for c in verdicts]
    return lines + ([] if verdicts else ["- no cell tests a paper claim"])


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
