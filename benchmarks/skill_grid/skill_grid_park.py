"""Carry the skill grid's unfinished runs across a stop of the machine, through git.

``park``: copy each unfinished run's resumable state (``config.json``, the newest complete
checkpoint — safetensors + JSON, about 1.1 MB —, ``metrics.jsonl``, ``timings.jsonl``, the start
grid, the trained tensors of each mid-run snapshot, ``snapshots/iteration-K/trainable.safetensors``,
about 270 KB, which the published run keeps) from ``RUNS`` into ``DEST/<run>/``. A run that finished
training but is not yet published (``DEST/../runs/<run>.json`` missing: its evaluations were cut off) is
parked too, with what the bench needs to evaluate and publish it (``summary.json``, the EMA weights
``final/trainable.safetensors``, the evaluations already written); runs published by ``flowcredit bench
--publish`` are not. ``restore``: copy them back into ``RUNS`` unless the run is there already; then
the same ``flowcredit bench`` command resumes them from their checkpoints (resume is exact:
docs/testing.md) or evaluates and publishes them, and the parked copies can be deleted.

    .venv/bin/python benchmarks/skill_grid/skill_grid_park.py park      # RUNS, DEST: the defaults below
    .venv/bin/python benchmarks/skill_grid/skill_grid_park.py restore
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from flowcredit.run.checkpoint import find_checkpoint

KEEP = ("config.json", "metrics.jsonl", "timings.jsonl", "grid_start_test.png", "provenance.jsonl")
FINISHED_KEEP = ("summary.json", "psi.json", "calibration.json", "final/trainable.safetensors")
"""What a finished, unpublished run needs besides ``KEEP`` for its evaluations and ``--publish``."""
EVALUATIONS = ("heldout/eval.json", "confirm/eval.json")


def park(runs: Path, dest: Path) -> list[str]:
    """Copy the resumable state of every unfinished run with a checkpoint, and of every finished run
    not yet published; returns their names."""
    parked = []
    for run in sorted(p for p in runs.iterdir() if p.is_dir()):
        checkpoint = find_checkpoint(run)
        done = finished(run)
        if (done and published(run, dest)) or (not done and checkpoint is None):
            continue
        target = dest / run.name
        tmp = dest / f".{run.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in KEEP + (FINISHED_KEEP + EVALUATIONS if done else ()):
            if (run / name).is_file():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(run / name, tmp / name)
        _relative_run_dir(tmp / "config.json", run)
        if not done:
            shutil.copytree(checkpoint, tmp / "checkpoint")
        for snapshot in sorted(run.glob("snapshots/iteration-*/trainable.safetensors")):  # mid-run weights
            (tmp / snapshot.parent.relative_to(run)).mkdir(parents=True)
            shutil.copy2(snapshot, tmp / snapshot.relative_to(run))
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        parked.append(run.name)
    for stale in (p for p in dest.iterdir() if p.is_dir() and p.name not in parked) if dest.exists() else []:
        if published(runs / stale.name, dest):  # published since it was parked
            shutil.rmtree(stale)
    return parked


def published(run: Path, dest: Path) -> bool:
    """The bench published the run: ``DEST/../runs/<run>.json`` (``dest`` is ``…/skill_compare/inflight``)."""
    return (dest.parent / "runs" / f"{run.name}.json").is_file()


def finished(run: Path) -> bool:
    """The run wrote its summary after its whole budget (a run stopped early by Ctrl-C also writes one,
    with fewer iterations: it is unfinished and parked)."""
    summary, config = run / "summary.json", run / "config.json"
    if not summary.is_file():
        return False
    if not config.is_file():
        return True
    return json.loads(summary.read_text())["iterations"] >= json.loads(config.read_text())["iterations"]


def _relative_run_dir(config: Path, run: Path) -> None:
    """A parked config names its run folder relative to where the grid runs, not by a machine's path
    (resuming ignores it: the bench passes ``--run_dir``)."""
    if not config.is_file():
        return
    data = json.loads(config.read_text())
    if Path(data.get("run_dir", "")).is_absolute():
        parts = run.parts  # the bench's layout: …/runs/<out>/runs/<run>, named from the first "runs"
        data["run_dir"] = run.as_posix() if not run.is_absolute() else "/".join(parts[parts.index("runs") :])
        config.write_text(json.dumps(data, indent=2) + "\n")


def restore(runs: Path, dest: Path) -> list[str]:
    """Copy parked runs back into ``runs`` where they are missing; returns their names."""
    restored = []
    for parked in sorted(p for p in dest.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if (runs / parked.name).exists():
            continue
        shutil.copytree(parked, runs / parked.name)
        restored.append(parked.name)
    return restored


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("park", "restore"))
    p.add_argument("runs", type=Path, nargs="?", default=Path("runs/skill_compare/runs"))
    p.add_argument("dest", type=Path, nargs="?", default=Path("benchmarks/results/skill_compare/inflight"))
    args = p.parse_args()
    args.runs.mkdir(parents=True, exist_ok=True)
    done = (park if args.action == "park" else restore)(args.runs, args.dest)
    print(f"{args.action}: {', '.join(done) or 'nothing'}")


if __name__ == "__main__":
    main()
