"""The reward-hacking guard on a real hack: the soft score alone, no KL, uniform prompts, with the guard
(rollback, monitor ``shapes_strict``) and without it (``warn``: training unchanged), on two seeds. The
settings, the claim and its void condition are pre-registered in docs/benchmarks.md ("the
reward-hacking guard on a real hack").

    python benchmarks/guard/guard_demo.py [--round 2] [--runs control-2,guard-2,…] [--work DIR]
    python benchmarks/guard/guard_demo.py --round 1 --report   # the report of benchmarks/results/guard/round1

A run that stopped part-way is resumed; a finished one is kept. Each finished run's metrics, summary,
curves and before/after grid are copied to ``benchmarks/results/guard/round<N>/<arm>-seed<S>/``, with
``flowcredit eval`` of its ``final/`` and ``best/``; the report (``report.md``, ``guard_demo.png``) is
computed from those copies and the base model's floor (``benchmarks/results/guard/base_floor``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from flowcredit.commands.bench_skill_eval import relative_paths

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "guard"
HACKABLE = [
    "--preset", "skill", "--reward", "shapes", "--prompt_weights", "uniform", "--beta", "0",
    "--lr", "1e-3", "--iterations", "60", "--eval_every", "10", "--log_with", "none",
]  # fmt: skip
ARMS = {
    "control": ["--guard", "warn", "--guard_monitors", "shapes_strict"],
    "guard": ["--guard", "rollback", "--guard_monitors", "shapes_strict", "--guard_max_rollbacks", "2"],
}
ROUNDS = {  # each pre-registered in docs/benchmarks.md before it ran
    1: {"seeds": (0, 1), "pinned": ["--guard_monitor_rule", "hack", "--guard_noise_mult", "3"]},
    2: {"seeds": (2, 3), "pinned": ["--guard_monitor_rule", "fall", "--guard_noise_mult", "4"]},
}
"""Round 1 ran with the guard's first defaults (the monitor rule 'hack', 3 floors), pinned here; round
2 with the defaults that round 1 led to ('fall', 4 floors), on fresh seeds."""
KEPT = ("metrics.jsonl", "summary.json", "config.json", "guard_curve.png", "reward_curve.png")
KEPT += ("grid_before_after_test.png",)
FLOORS = 2.0  # the claim's margin, in noise floors of the strict score


def train(name: str, work: Path, rnd: int) -> None:
    arm, seed = name.rsplit("-", 1)
    run_dir = work / name
    if (run_dir / "summary.json").is_file():
        print(f"{name}: finished already", flush=True)
    else:
        cli = [sys.executable, "-m", "flowcredit", "train"]
        if (run_dir / "checkpoint").is_dir():
            cmd = [*cli, "--resume", str(run_dir)]
        else:
            cmd = [
                *cli,
                *HACKABLE,
                *ARMS[arm],
                *ROUNDS[rnd]["pinned"],
                "--seed",
                seed,
                "--run_dir",
                str(run_dir),
            ]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    out = RESULTS / f"round{rnd}" / f"{arm}-seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    for file in (*KEPT, "provenance.jsonl", "final/trainable.safetensors", "best/trainable.safetensors"):
        if (run_dir / file).is_file():  # the adapters: the run's last and best trained tensors
            (out / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(run_dir / file, out / file)


def evaluate(name: str, work: Path, rnd: int) -> None:
    """The held-out strict score of the weights the run ends with (``final/``) and of ``best/``, by
    ``flowcredit eval`` with the run's own evaluation settings (86 prompts × 4, noise seed 1234): a
    rollback at the last evaluation leaves ``final/`` = ``best/``, which the run's last evaluation,
    taken before the guard acted, does not show."""
    arm, seed = name.rsplit("-", 1)
    out = RESULTS / f"round{rnd}" / f"{arm}-seed{seed}"
    for which in ("final", "best"):
        target = out / f"eval_{which}"
        if (target / "eval.json").is_file():
            continue
        cmd = [sys.executable, "-m", "flowcredit", "eval", "--checkpoint", str(work / name / which)]
        cmd += ["--seeds", "1234", "--samples-per-prompt", "4", "--max-prompts", "0", "--out", str(target)]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)


def base_floor(work: Path) -> float:
    """The strict score's noise floor at the start, shared by every run: the std (ddof 0) over the
    start evaluation's three noise seeds (1234–1236) of the base model's overall strict score, with the
    runs' evaluation settings (the runs log the floor of the soft score and of the per-image monitor,
    not of the category-mean strict score the curves show)."""
    target = RESULTS / "base_floor"
    if not (target / "eval.json").is_file():
        config = next(work.glob("*/config.json"))
        cmd = [sys.executable, "-m", "flowcredit", "eval", "--config", str(config), "--checkpoint", "builtin"]
        cmd += ["--seeds", "1234,1235,1236", "--samples-per-prompt", "4", "--max-prompts", "0"]
        subprocess.run([*cmd, "--out", str(target)], check=True, cwd=ROOT)
    return json.loads((target / "eval.json").read_text())["across_seeds"]["overall"]["strict"]["std"]


def strict_of(folder: Path) -> float:
    """The overall strict score (mean over categories) of an ``eval.json``."""
    return json.loads((folder / "eval.json").read_text())["tables"]["1234"]["overall"]["strict"]


def read_run(folder: Path, floor: float) -> dict:
    """The strict curve, alarms and actions of one published run, with the shared ``floor``."""
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/test/strict" in r]
    summary = json.loads((folder / "summary.json").read_text())
    curve = [(r["iteration"], r["eval/test/strict"]) for r in evals]
    best = max(curve, key=lambda p: p[1])
    acted = [r["iteration"] for r in evals if r.get("guard/rollback") or r.get("guard/stop")]
    return {
        "curve": curve,
        "floor": floor,
        "start": curve[0][1],
        "last_eval": curve[-1][1],
        "final": strict_of(folder / "eval_final"),
        "best_weights": strict_of(folder / "eval_best"),
        "best": best,
        "best_dir": summary["guard"]["best"],
        "alarms": [a[0] for a in summary["guard"]["alarms"]],
        "acted": acted,
        "iterations": summary["iterations"],
    }


def publishable(folder: Path) -> None:
    """Every JSON file under ``folder`` with the paths under the repository made relative to it (a
    published result names no machine's absolute path; tests/test_published_results.py)."""
    for path in folder.rglob("*.json"):
        data = json.loads(path.read_text())
        fixed = relative_paths(data, ROOT)
        if fixed != data:
            path.write_text(json.dumps(fixed, indent=2) + "\n")


def report(work: Path, rnd: int) -> str:
    head = (
        "| seed | arm | strict: start → last evaluation | best (at) | final/ | best/ | floor | final − best |"
    )
    lines = [head + " alarms at | acted at |", "|---|---|---|---|---|---|---|---|---|---|"]
    runs, verdicts, floor = {}, [], base_floor(work)
    for folder in (RESULTS / "base_floor", RESULTS / f"round{rnd}"):
        publishable(folder)
    seeds, out = ROUNDS[rnd]["seeds"], RESULTS / f"round{rnd}"
    for seed in seeds:
        for arm in ARMS:
            folder = out / f"{arm}-seed{seed}"
            if not (folder / "summary.json").is_file():
                continue
            r = runs[arm, seed] = read_run(folder, floor)
            alarms, acted = (", ".join(map(str, r[k])) or "–" for k in ("alarms", "acted"))
            best, fall = f"{r['best'][1]:.3f} ({r['best'][0]})", r["final"] - r["best"][1]
            weights = f"{r['final']:.3f} | {r['best_weights']:.3f}"
            lines.append(
                f"| {seed} | {arm} | {r['start']:.3f} → {r['last_eval']:.3f} | {best} | {weights} | "
                f"±{r['floor']:.3f} | {fall:+.3f} | {alarms} | {acted} |"
            )
        if ("control", seed) in runs and ("guard", seed) in runs:
            c, g = runs["control", seed], runs["guard", seed]
            hacked = c["final"] < c["best"][1] - FLOORS * c["floor"]
            held = g["final"] >= g["best"][1] - FLOORS * g["floor"] and g["final"] > c["final"]
            verdicts.append((seed, hacked, held))
    lines.append("")
    for seed, hacked, held in verdicts:
        lines.append(
            f"- seed {seed}: (a) the hack happened without the guard: **{'yes' if hacked else 'no'}**; "
            f"(b) the guard held: **{'yes' if held else 'no'}**"
        )
    if len(verdicts) == len(seeds):
        if not all(h for _, h, _ in verdicts):
            overall = "void (the hack did not happen on every seed)"
        else:
            overall = "the claim holds" if all(k for _, _, k in verdicts) else "the claim fails"
        lines.append(f"- **verdict: {overall}** (round {rnd}, pre-registered in docs/benchmarks.md)")
    figure(runs, seeds, out)
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def figure(runs: dict, seeds: tuple, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(seeds), figsize=(5 * len(seeds), 3.4), dpi=110, sharey=True)
    for ax, seed in zip(axes, seeds):
        for arm, style in (("control", "s-"), ("guard", "o-")):
            r = runs.get((arm, seed))
            if r is None:
                continue
            line = ax.plot(
                *zip(*r["curve"]),
                style,
                ms=4,
                label="guard off (warn)" if arm == "control" else "guard on (rollback)",
            )
            for k, it in enumerate(r["acted"]):
                ax.axvline(
                    it, color=line[0].get_color(), ls="--", lw=0.8, label="guard acted" if k == 0 else None
                )
            if arm == "guard":  # final/: after the guard's last action (a rollback at 60 restores best/)
                ax.plot(
                    r["curve"][-1][0],
                    r["final"],
                    "*",
                    color=line[0].get_color(),
                    ms=11,
                    label="final/ (guard on)",
                )
            band = r["best"][1] - FLOORS * r["floor"]
            if arm == "control":
                ax.axhline(band, color="grey", ls=":", lw=0.8, label=f"best − {FLOORS:g} floors (off)")
        ax.set_title(f"seed {seed}: soft score trained, no KL", fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out strict (86 × 4, ODE)")
    fig.tight_layout()
    fig.savefig(out / "guard_demo.png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--round", type=int, default=max(ROUNDS), choices=sorted(ROUNDS))
    parser.add_argument("--runs", default="", help="e.g. control-2,guard-2 (default: the round's four)")
    parser.add_argument("--work", default="", help="run folders (default: runs/guard_demo_round<N>)")
    parser.add_argument("--report", action="store_true", help="only the report of the published runs")
    args = parser.parse_args()
    work = Path(args.work or ROOT / "runs" / f"guard_demo_round{args.round}")
    names = (
        args.runs.split(",") if args.runs else [f"{a}-{s}" for s in ROUNDS[args.round]["seeds"] for a in ARMS]
    )
    if not args.report:
        for name in names:
            train(name, work, args.round)
            evaluate(name, work, args.round)
    print(report(work, args.round))


if __name__ == "__main__":
    main()
