"""Training summaries of ``skill`` runs (issue "Skill, not prompts"), as docs/recipes.md records them.

For each run directory: the 10-iteration means of the training strict and soft scores and of the
KL, the run's own evaluations (strict/soft by iteration) and the median seconds per iteration.
With ``--paired REF``, also the 10-iteration means of the paired difference run − REF of the
training strict and soft scores. Two runs with the same seed draw the same prompts and the same
rollout noise, so until their policies part the difference is 0, and afterwards it measures what the
recipe changed on the very prompts it trained on, free of the prompt-draw noise that dominates
either run's own curve.

    .venv/bin/python benchmarks/recipes/skill_runs.py runs/skill/H-s0 runs/skill/I-s0 --paired runs/skill/G-s0
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _rows(run: Path, name: str) -> list[dict]:
    path = run / name
    if not path.exists():
        raise SystemExit(f"{path} does not exist: is {run} a training run's directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def block_means(values: list[float], block: int = 10, digits: int = 3) -> list[float]:
    """Means of consecutive blocks of ``block`` values (the last one may be shorter)."""
    return [round(statistics.fmean(values[i : i + block]), digits) for i in range(0, len(values), block)]


def training(metrics: list[dict]) -> dict[int, dict]:
    """Iteration → the training row (the rows of ``metrics.jsonl`` that carry a reward)."""
    return {r["iteration"]: r for r in metrics if "reward/mean" in r}


def summary(run: Path) -> dict:
    """The fields docs/recipes.md records for one run."""
    metrics = _rows(run, "metrics.jsonl")
    rows = list(training(metrics).values())
    evals = [r for r in metrics if "eval/test/strict" in r]
    seconds = [t["time/iteration_s"] for t in _rows(run, "timings.jsonl")]
    return {
        "iterations": len(rows),
        "median_s_per_iteration": round(statistics.median(seconds), 2) if seconds else None,
        "train_strict_10_iteration_means": block_means([r["reward/shapes_strict"] for r in rows]),
        "train_soft_10_iteration_means": block_means([r["reward/shapes"] for r in rows]),
        "kl_10_iteration_means": block_means([r["loss/kl"] for r in rows], digits=8),
        "in_run_eval_86x4": [
            {"iteration": r["iteration"], **{k: round(r[f"eval/test/{k}"], 4) for k in ("strict", "soft")}}
            for r in evals
        ],
    }


def paired(run: Path, ref: Path) -> dict:
    """10-iteration means of run − ref on the iterations both have, for the strict and soft scores."""
    a, b = training(_rows(run, "metrics.jsonl")), training(_rows(ref, "metrics.jsonl"))
    both = sorted(set(a) & set(b))
    return {
        key: block_means([a[i][f"reward/{key}"] - b[i][f"reward/{key}"] for i in both])
        for key in ("shapes_strict", "shapes")
    } | {"iterations": len(both)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="training run directories")
    p.add_argument("--paired", type=Path, default=None, help="a run of the same seed to difference against")
    p.add_argument("--json", default="", help="also write every number to this JSON file")
    args = p.parse_args()
    out = {}
    for run in args.runs:
        out[run.name] = summary(run)
        if args.paired is not None:
            out[run.name]["paired_minus_" + args.paired.name] = paired(run, args.paired)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
