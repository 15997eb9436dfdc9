"""Plot a sweep file (``sweep.py``'s output): evaluation soft score vs minutes, one line per seed.

.venv/bin/python benchmarks/recipes/plot_sweep.py benchmarks/results/sweep.jsonl \\
    docs/img/demo_eval_vs_minutes.png
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, out: str) -> None:
    rows = [json.loads(x) for x in open(src).read().splitlines()]
    curves = defaultdict(list)
    for r in rows:
        if "summary" not in r:
            curves[(r["recipe"], r["seed"])].append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110, sharey=False)
    for (recipe, seed), pts in sorted(curves.items()):
        for ax, key in zip(axes, ("eval/train/soft", "eval/test/soft")):
            ax.plot([p["minutes"] for p in pts], [p[key] for p in pts], "o-", label=f"{recipe} seed {seed}")
    for ax, title in zip(axes, ("trained prompts (4 counting prompts × 8)", "held-out prompts (16 × 8)")):
        floor = next(p for p in rows if "eval/test/floor_soft" in p)
        key = "eval/train/floor_soft" if "trained" in title else "eval/test/floor_soft"
        ax.axhline(floor[key.replace("floor_soft", "soft")], color="grey", lw=0.8, ls="--")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("wall-clock minutes (iterations + periodic evaluation)")
        ax.set_ylabel("ShapeEval soft (ODE, fixed noise)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
