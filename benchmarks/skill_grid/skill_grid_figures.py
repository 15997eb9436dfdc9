"""The skill comparison's figures (``skill_grid_report.py`` writes them): ``compare.png`` (held-out
scores per category, every seed a dot), ``curves.png`` (training reward per arm against iterations and
against network calls spent) and ``heldout_vs_nfe.png`` (held-out strict against a run's network calls)."""

from __future__ import annotations

from pathlib import Path

from flowcredit.commands.bench_skill import run_cost
from flowcredit.commands.bench_stats import ci95
from flowcredit.tasks.shapes import CATEGORIES

PARTS = ("overall", "per_image", *CATEGORIES)


def _bars(ax, title: str, rows: dict[str, list[list[float]]]) -> None:
    """Grouped bars: ``rows[label][part]`` holds one value per seed (mean bar, seed dots, 95 % whisker)."""
    width = 0.8 / max(len(rows), 1)
    for i, (label, per_part) in enumerate(rows.items()):
        xs = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(PARTS))]
        means = [sum(v) / len(v) for v in per_part]
        colour = ax.bar(xs, means, width * 0.9, label=f"{label} (n={len(per_part[0])})", alpha=0.6)
        for x, values in zip(xs, per_part):
            ax.scatter([x] * len(values), values, s=8, color=colour.patches[0].get_facecolor(), edgecolor="k")
            if len(values) >= 2:
                ax.errorbar(x, sum(values) / len(values), yerr=ci95(values)[1], color="k", lw=0.8, capsize=2)
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xticks(range(len(PARTS)), PARTS, rotation=30, ha="right")
    ax.set_title(title, fontsize=10)
    if rows:
        ax.legend(fontsize=7)


def figure(rep: dict, path: Path) -> Path:
    """Held-out strict per category: each arm's change from the base (left) and its paired difference to
    Flow-GRPO (right); bars are seed means, dots single seeds, whiskers 95 % t-intervals (n ≥ 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def strict(arm: str, seed: int, part: str) -> float:
        return rep["arms"][arm]["per_seed"][seed]["strict"][part]

    base = rep["base"]["strict"]
    change = {
        arm: [[strict(arm, s, p) - base[p] for s in a["seeds"]] for p in PARTS]
        for arm, a in rep["arms"].items()
    }
    paired = {
        arm: [[strict(arm, s, p) - strict("skill", s, p) for s in a["seeds"]] for p in PARTS]
        for arm, a in rep["paired"].items()
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    _bars(axes[0], "change from the base checkpoint", change)
    _bars(axes[1], "paired difference to Flow-GRPO (skill), same seeds", paired)
    axes[0].set_ylabel("held-out strict (86 prompts × 16 × 2 noise seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` iterations (the training reward is one noisy batch each)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def curves(records: dict[str, dict], path: Path, window: int = 25) -> Path:
    """Training reward (trailing mean over ``window`` iterations) per arm against the iteration (left) and
    against the network calls spent (right: "at equal compute"); thin lines are seeds, thick the mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms: dict[str, list[dict]] = {}
    for name, rec in records.items():
        if "curve" in rec and "-seed" in name:
            arms.setdefault(name.rsplit("-seed", 1)[0], []).append(rec["curve"])
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
    for color, (arm, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], sorted(arms.items())):
        n = min(len(c["reward"]) for c in runs)
        smooth = [_smooth(c["reward"][:n], window) for c in runs]
        mean = [sum(col) / len(col) for col in zip(*smooth)]
        for ax, key, scale in ((axes[0], "iteration", 1), (axes[1], "nfe", 1e6)):
            for c, ys in zip(runs, smooth):
                ax.plot([x / scale for x in c[key][:n]], ys, color=color, lw=0.6, alpha=0.35)
            xs = [sum(c[key][i] for c in runs) / len(runs) / scale for i in range(n)]
            ax.plot(xs, mean, color=color, lw=2, label=f"{arm} (n={len(runs)})")
    axes[0].set_xlabel("iteration")
    axes[1].set_xlabel("network calls spent (millions; rollout + update + values)")
    axes[0].set_ylabel(f"training reward (trailing mean, {window} it.)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_points(arm: str, a: dict, records: dict[str, dict], base: float) -> list[tuple[float, float, bool]]:
    """Per seed of the arm: (network calls in millions, held-out strict − base, calls logged). A run
    published without its training curve (before 2026-12-03) logged no calls: it stands at the mean of
    its arm's logged runs, so that every seed of the table counts in the arm's mean."""
    points = []
    for seed in a["seeds"]:
        rec = records.get(f"{arm}-seed{seed}", {})
        logged = bool(rec.get("curve")) and "config" in rec
        calls = float("nan")
        if logged:
            cost = run_cost(rec)
            calls = (cost["train_nfe"] + cost["calibration_nfe"]) / 1e6
        points.append((calls, a["per_seed"][seed]["strict"]["overall"] - base, logged))
    known = [x for x, _, logged in points if logged]
    if not known:
        return []
    return [(x if logged else sum(known) / len(known), y, logged) for x, y, logged in points]


def heldout_vs_nfe(rep: dict, records: dict[str, dict], path: Path) -> Path:
    """Held-out strict (change from the base) against the network calls a run spent, one dot per run, the
    arm's seed mean as a larger marker: what each credit rule buys per unit of compute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rep["base"]["strict"]["overall"]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    unlogged = False
    for color, (arm, a) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], rep["arms"].items()):
        points = run_points(arm, a, records, base)
        if not points:
            continue
        xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
        for x, y, logged in points:
            ax.scatter([x], [y], s=14, alpha=0.5, color=color if logged else "none", edgecolor=color)
            unlogged |= not logged
        ax.scatter(
            [sum(xs) / len(xs)],
            [sum(ys) / len(ys)],
            color=color,
            s=70,
            edgecolor="k",
            label=f"{arm} (n={len(xs)})",
        )
    ax.axhline(0, color="k", lw=0.6)
    xlabel = "network calls per run (millions; training + ψ calibration)"
    if unlogged:
        xlabel += "\nhollow: a run published without its calls, at its arm's mean"
    ax.set_xlabel(xlabel)
    ax.set_ylabel("held-out strict − base")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
