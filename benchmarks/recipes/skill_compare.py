"""Held-out ShapeEval before/after of the ``skill`` preset (issue "Skill, not prompts").

Reads ``eval.json`` files written by ``flowcredit eval --out`` with the same prompts, samples per
prompt and noise seeds (so every sample is paired with its own before), and prints per category and
overall (the mean over categories, as GenEval) the strict and soft scores before and after, the
change, the mean over all images (where ``position``'s 40 prompts weigh most), the evaluation
floor (std over the noise seeds of the overall score, as the run's own evaluation measures it) and
a 95 % bootstrap interval of the paired change (prompts resampled within
their category, 2,000 draws, fixed seed).

    .venv/bin/python benchmarks/recipes/skill_compare.py runs/skill/base-eval/eval.json \
        runs/skill/tp-s0-eval/eval.json runs/skill/tp-s1-eval/eval.json --names base,tp-s0,tp-s1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from flowcredit.tasks.shapes.prompts import CATEGORIES


def per_prompt(result: dict, key: str) -> tuple[np.ndarray, list[str]]:
    """``(P, seeds·k)`` scores of every prompt (rows in the prompt order) and the prompts."""
    k = result["samples_per_prompt"]
    runs = [np.asarray(result["per_sample"][str(s)][key], dtype=np.float64) for s in result["seeds"]]
    per = np.concatenate([r.reshape(-1, k) for r in runs], axis=1)  # (P, seeds·k)
    return per, result["sample_prompts"][::k]


def overall(per: np.ndarray, cats: np.ndarray) -> float:
    """Mean over the categories present of the category means."""
    return float(np.mean([per[cats == c].mean() for c in np.unique(cats)]))


def floor(result: dict, key: str) -> float:
    """Std (ddof 0) over the noise seeds of the overall score."""
    return float(np.std([result["tables"][str(s)]["overall"][key] for s in result["seeds"]]))


def bootstrap_change(before: np.ndarray, after: np.ndarray, cats: np.ndarray, draws: int = 2000) -> tuple:
    """2.5 % and 97.5 % quantiles of the overall paired change, prompts resampled within categories."""
    rng = np.random.default_rng(0)
    diff = (after - before).mean(axis=1)  # (P,) paired change of every prompt
    groups = [np.flatnonzero(cats == c) for c in np.unique(cats)]
    stats = [np.mean([diff[rng.choice(g, len(g))].mean() for g in groups]) for _ in range(draws)]
    return float(np.quantile(stats, 0.025)), float(np.quantile(stats, 0.975))


def compare(base: dict, trained: dict, key: str) -> dict:
    """Per-category before/after/change, overall change, its floor and its bootstrap interval."""
    for field in ("samples_per_prompt", "seeds", "sample_prompts"):
        if base[field] != trained[field]:
            raise SystemExit(f"the two evaluations differ in {field!r}: not paired")
    b, prompts = per_prompt(base, key)
    a, _ = per_prompt(trained, key)
    meta = {m["prompt"]: m["category"] for m in _test_prompts()}
    cats = np.asarray([meta[p] for p in prompts])
    rows = {c: (b[cats == c].mean(), a[cats == c].mean()) for c in CATEGORIES if c in set(cats)}
    lo, hi = bootstrap_change(b, a, cats)
    return {
        "categories": {c: {"before": x, "after": y, "change": y - x} for c, (x, y) in rows.items()},
        "before": overall(b, cats),
        "after": overall(a, cats),
        "change": overall(a, cats) - overall(b, cats),
        "floor": max(floor(base, key), floor(trained, key)),
        "ci95": [lo, hi],
        "per_image": {"before": float(b.mean()), "after": float(a.mean())},  # every image weighs alike
    }


def _test_prompts() -> list[dict]:
    from flowcredit.tasks.prompt_sets import read_prompts

    return read_prompts("test")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="eval.json of the starting checkpoint")
    p.add_argument("trained", nargs="+", help="eval.json of trained checkpoints")
    p.add_argument("--names", default="", help="comma list: a name for the base and for each trained file")
    p.add_argument("--json", default="", help="also write every number to this JSON file")
    args = p.parse_args()
    base = json.loads(Path(args.base).read_text())
    names = args.names.split(",")[1:] if args.names else [Path(t).parent.name for t in args.trained]
    out = {}
    for name, path in zip(names, args.trained, strict=True):
        trained = json.loads(Path(path).read_text())
        out[name] = {key: compare(base, trained, key) for key in ("strict", "soft")}
        for key, r in out[name].items():
            print(
                f"\n{name} {key}: {r['before']:.3f} -> {r['after']:.3f} ({r['change']:+.3f}, "
                f"floor ±{r['floor']:.3f}, 95% CI [{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}])"
            )
            print(f"  per image     {r['per_image']['before']:.3f} -> {r['per_image']['after']:.3f}")
            for cat, c in r["categories"].items():
                print(f"  {cat:<14}{c['before']:.3f} -> {c['after']:.3f} ({c['change']:+.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
