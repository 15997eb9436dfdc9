"""Recipe sweep for the built-in task (issue "make the built-in task learn").

Runs each recipe (a preset plus ``--field value`` overrides) for each seed, one run at a time (never
two torch jobs at once on a small CPU), and appends one JSON line per evaluation to the output file:
``{"recipe", "seed", "iteration", "minutes", "eval/train/soft", "eval/test/soft", "floor/..."}``.
A finished (recipe, seed) cell is skipped on re-runs.

    .venv/bin/python benchmarks/recipes/sweep.py --recipes benchmarks/recipes/recipes.json --seeds 0,1,2 \
        --out benchmarks/results/sweep.jsonl
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from flowcredit.presets import load_config
from flowcredit.run.runlog import read_metrics
from flowcredit.train import train


def run_cell(name: str, preset: str, overrides: list[str], seed: int, work: Path) -> list[dict]:
    run_dir = work / f"{name}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = load_config(preset, None, [*overrides, "--seed", str(seed), "--run_dir", str(run_dir)])
    summary = train(cfg)
    timings = [json.loads(x) for x in (run_dir / "timings.jsonl").read_text().splitlines()]
    elapsed, minutes = 0.0, {0: 0.0}
    for t in timings:
        elapsed += t["time/iteration_s"] / 60
        minutes[t["iteration"]] = elapsed
    rows = []
    for m in read_metrics(run_dir):
        evals = {k: v for k, v in m.items() if k.startswith("eval/")}
        if evals:
            rows.append(
                {
                    "recipe": name,
                    "seed": seed,
                    "iteration": m["iteration"],
                    "minutes": round(minutes.get(m["iteration"], float("nan")), 3),
                    **evals,
                }
            )
    rows.append({"recipe": name, "seed": seed, "summary": summary})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipes", required=True, help='JSON: {"name": {"preset": "demo", "overrides": [...]}}')
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="benchmarks/results/sweep.jsonl")
    p.add_argument("--work", default="runs/sweep")
    args = p.parse_args()
    recipes = json.loads(Path(args.recipes).read_text())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        done = {(r["recipe"], r["seed"]) for r in rows if "summary" in r}
    for name, spec in recipes.items():
        for seed in [int(s) for s in args.seeds.split(",")]:
            if (name, seed) in done:
                continue
            preset, overrides = spec.get("preset", "demo"), spec.get("overrides", [])
            rows = run_cell(name, preset, overrides, seed, Path(args.work))
            with open(out, "a") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
