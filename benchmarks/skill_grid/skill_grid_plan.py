"""How far the CPU skill grid got and how long the rest takes: every run of ``skill_grid.sh`` (beside this)
in its order, with its state (published, at checkpoint k of n, or not started) and the hours it still
needs on this machine; with ``--straddling``, which arms still have an inconclusive verdict (the grid
gives them more seeds).

    .venv/bin/python benchmarks/skill_grid/skill_grid_plan.py [--worktree /work/grid]
    .venv/bin/python benchmarks/skill_grid/skill_grid_plan.py --straddling stepwise,dense [--published DIR]

Seconds per iteration per arm: the median of ``timings.jsonl`` over that arm's runs on this machine (the
grid's worktree and the parked copies: the median ignores the iterations a pause or other work
stretched); for an arm not run yet, its side-by-side time from ``iteration_times.json``
(``benchmarks/speed/skill_rate.py --arms``) scaled by how the measured arms ran against theirs; otherwise
unknown. Each run also pays its held-out evaluation (the median gap between a run's ``final/`` and its
``heldout/eval.json``). Estimates, for planning: the grid yields the CPU to other work, so the wall
time is longer.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results" / "skill_compare"


def grid_runs(script: Path) -> list[tuple[str, str]]:
    """``[(arm, run name)]`` in the order ``skill_grid.sh`` trains them: per ``bench ARMS SEEDS`` line and
    seed, the preset itself (arm ``skill``), then each arm; a run listed twice counts once."""
    runs: list[tuple[str, str]] = []
    for arms, seeds in re.findall(r"^bench (\S+) (\S+)", script.read_text(), flags=re.M):
        for seed in seeds.split(","):
            for arm in ["skill", *arms.split(",")]:
                name = f"skill-seed{seed}" if arm == "skill" else f"skill-{arm}-seed{seed}"
                if (arm, name) not in runs:
                    runs.append((arm, name))
    return runs


def timed_seconds(times: dict) -> dict[str, float]:
    """Seconds of one iteration per arm from ``iteration_times.json`` (``benchmarks/speed/skill_rate.py
    --arms --out``): its ``arms``, one side-by-side run, then the arms of each of its ``later`` runs
    (``skill_rate.py --arms --later``) not timed before, scaled by the first run's ``skill`` seconds ÷
    that run's, so that every arm's ratio to Flow-GRPO is the one of the run that timed it."""
    seconds = dict(times.get("arms", {}))
    for run in times.get("later", []):
        scale = seconds["skill"] / run["arms"]["skill"]
        seconds |= {arm: s * scale for arm, s in run["arms"].items() if arm not in seconds}
    return seconds


def run_state(name: str, places: list[Path], published: Path) -> tuple[int | None, str]:
    """``(iteration of the newest checkpoint or None, where)``; ``"published"`` when the run's JSON is."""
    if (published / f"{name}.json").is_file():
        return None, "published"
    for place in places:
        state = place / name / "checkpoint" / "state.json"
        if state.is_file():
            return json.loads(state.read_text())["iteration"], place.name
    return 0, "not started"


def median_seconds(places: list[Path], least: int = 10) -> dict[str, float]:
    """Per arm: the median seconds of an iteration over every ``timings.jsonl`` of its runs here (an
    iteration logged twice across a resume counts once), for arms with at least ``least`` iterations
    timed (a run's first two iterations, paused by a test suite, once planned it at 204 hours)."""
    from flowcredit.run.runlog import read_iteration_seconds

    per_arm: dict[str, list[float]] = {}
    for place in places:
        for timings in place.glob("skill-*-seed*/timings.jsonl"):
            arm = timings.parent.name.removeprefix("skill-").rsplit("-seed", 1)[0]
            per_arm.setdefault(arm, []).extend(read_iteration_seconds(timings.parent).values())
    return {arm: statistics.median(values) for arm, values in per_arm.items() if len(values) >= least}


def seconds_per_iteration(measured: dict[str, float], timed: dict[str, float]) -> dict[str, float]:
    """``measured`` (this machine's runs), completed by ``timed`` (side by side) × the median ratio of
    measured to timed over the arms that have both (1 when none has)."""
    both = [measured[a] / timed[a] for a in measured if a in timed]
    scale = statistics.median(both) if both else 1.0
    return {**{a: s * scale for a, s in timed.items()}, **measured}


def evaluation_minutes(worktree_runs: Path, default: float = 4.0) -> float:
    """The median minutes between a finished run's ``final/`` and its ``heldout/eval.json``."""
    gaps = [
        (run / "heldout" / "eval.json").stat().st_mtime - (run / "final").stat().st_mtime
        for run in worktree_runs.glob("skill-*-seed*")
        if (run / "heldout" / "eval.json").is_file() and (run / "final").is_dir()
    ]
    return statistics.median(gaps) / 60 if gaps else default


def total_iterations(arm: str) -> int:
    """The run's iterations: the ``skill`` preset's, or with the arm's change (``bench_skill.SKILL_ARMS``)."""
    from flowcredit.commands.bench_skill import SKILL_ARMS
    from flowcredit.presets import load_config

    base = load_config("skill", None, [])
    change = SKILL_ARMS.get(arm, [])
    return load_config("skill", None, change(base) if callable(change) else change).iterations


def straddling(published: Path, arms: list[str]) -> list[str]:
    """The ``arms`` whose verdict against Flow-GRPO on the primary metric is still "inconclusive", from
    the runs published in ``published`` (issue 37: they get seeds 14–17); an arm without paired runs is
    left out."""
    from flowcredit.commands.bench_skill import skill_report
    from flowcredit.tasks.shapes import load_prompts

    records = {f.stem: json.loads(f.read_text()) for f in sorted(published.glob("*.json"))}
    categories = {m["prompt"]: m["category"] for m in load_prompts("test")}
    paired = skill_report(records, categories)["paired"]
    verdicts = {
        arm: paired[f"skill-{arm}"]["verdict"]["strict/overall"] for arm in arms if f"skill-{arm}" in paired
    }
    return [arm for arm, verdict in verdicts.items() if verdict.startswith("inconclusive")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worktree", default="/work/grid", help="the grid's worktree (skill_grid_bg.sh)")
    p.add_argument(
        "--straddling",
        metavar="ARMS",
        help="only print which of these arms (a comma list) are still inconclusive, comma-separated",
    )
    p.add_argument(
        "--published", default=str(RESULTS / "runs"), help="the published runs (with --straddling)"
    )
    args = p.parse_args()
    if args.straddling:
        print(",".join(straddling(Path(args.published), args.straddling.split(","))))
        return
    worktree_runs = Path(args.worktree) / "runs" / "skill_compare" / "runs"
    places = [worktree_runs, RESULTS / "inflight"]
    timed_file = RESULTS / "iteration_times.json"
    timed = timed_seconds(json.loads(timed_file.read_text())) if timed_file.is_file() else {}
    speed = seconds_per_iteration(median_seconds(places), timed)
    eval_min = evaluation_minutes(worktree_runs)
    print("| run | state | iterations | s per iteration | hours left |\n|---|---|---|---|---|")
    hours, unknown = 0.0, []
    for arm, name in grid_runs(HERE / "skill_grid.sh"):
        done, where = run_state(name, places, RESULTS / "runs")
        if done is None:
            print(f"| {name} | published | | | |")
            continue
        total = total_iterations(arm)
        if arm in speed:
            left = ((total - done) * speed[arm] / 60 + eval_min) / 60
            hours += left
            cells = f"{speed[arm]:.1f} | {left:.1f}"
        else:
            unknown.append(name)
            cells = "? | ?"
        state = "not started" if where == "not started" else f"checkpoint ({where})"
        print(f"| {name} | {state} | {done} / {total} | {cells} |")
    print(f"\nLeft: {hours:.1f} h of known runs (evaluation {eval_min:.1f} min each)", end="")
    print(f"; {len(unknown)} runs of arms never timed here." if unknown else ".")
    if wanted := re.search(r"--straddling (\S+)", (HERE / "skill_grid.sh").read_text()):
        now = straddling(RESULTS / "runs", wanted.group(1).split(","))
        print(f"Not counted: seeds 14–17 of the arms of {wanted.group(1)} still inconclusive when their turn")
        print(f"comes (today: {', '.join(now) or 'none'}).")


if __name__ == "__main__":
    main()
