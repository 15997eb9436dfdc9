"""``flowcredit bench``: credit-assignment methods compared on the built-in task with equal budgets.

Each cell (a preset, or a preset with one ablation, × a seed) is one ``flowcredit.train.train`` run in
``OUT/runs/<cell>-seed<k>``: same iterations (``--iterations``) or same wall clock (``--minutes`` →
``max_minutes``), same held-out prompts, evaluation interval and fixed evaluation noise. A finished
run (``summary.json`` after its whole budget) is read, not recomputed; an interrupted one resumes
from its checkpoint (a wall-clock cell restarts, so that its budget stays whole); a run whose config
differs from the requested one is an error, never mixed in. Outputs: ``OUT/results.json`` (every
evaluation point with iteration, seconds from ``timings.jsonl``, cumulative NFE from
``metrics.jsonl``), ``OUT/table.md``, and held-out score vs iteration / seconds / NFE plots.
Honesty notes: 1) seconds are the trainer's per-iteration wall clock, evaluation included (the same
for every method); set-up (model load, DenseGRPO's ψ calibration, start evaluation) is reported
apart. 2) NFE counts training calls only (rollout + values + update), not calibration or
evaluation. 3) No per-category bars: the trainer logs the overall held-out score only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import time
from functools import partial
from operator import itemgetter
from pathlib import Path

from flowcredit.config import Config, load_config, trained_window

QUICK = (
    "--iterations 2 --prompts_per_iter 2 --group_size 4 --num_steps 5 --window_size 0 "
    "--num_eval_prompts 2 --eval_samples_per_prompt 2 --eval_every 1 --calib_max_iters 1 --calib_groups 1 "
    "--batch_size 16"
).split()
"""``--quick``: a few-minute smoke run (window_size 0 = every trainable step of the 5)."""

FULL = ["--iterations", "40", "--eval_every", "5"]
"""Defaults of a full comparison (any ``--field value`` given to the command overrides them)."""


def _half_window(cfg: Config) -> list[str]:
    return ["--window_size", str(max(1, trained_window(cfg)[1] // 2))]


ABLATIONS = {
    "tp_grpo": {
        "no_constraint": ["--tp_constrained", "false"],
        "no_first_step": ["--tp_first_step", "false"],
        "no_balance": ["--tp_balance", "none"],
        "half_window": _half_window,
    },
    "stepwise_grpo": {"per_step_norm": ["--credit", "dense"]},
    "dense_grpo": {
        "uniform_noise": ["--calibrate", "false"],
        "euler1": ["--estimator", "euler", "--substeps", "1"],
        "euler5": ["--estimator", "euler", "--substeps", "5"],
    },
}
"""``--ablations``: variants of each selected preset (ode_remaining is dense_grpo's own estimator)."""


def _parser() -> argparse.ArgumentParser:
    doc = (
        "Compare credit methods (presets × seeds, equal budgets); other --field value pairs override config."
    )
    p = argparse.ArgumentParser(prog="flowcredit bench", description=doc)
    p.add_argument("--presets", default="flow_grpo,dense_grpo,stepwise_grpo,tp_grpo")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2; --quick: 0)")
    p.add_argument("--iterations", type=int, default=None, help="iterations per run (default 40)")
    p.add_argument("--minutes", type=float, default=0.0, help="equal wall-clock budget per run instead")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in a few minutes")
    p.add_argument("--ablations", action="store_true", help="add the ablations of the selected presets")
    return p


def plan_cells(args, rest: list[str]) -> list[dict]:
    """``[{name, preset, ablation, overrides}]``; overrides are ``--key value`` strings."""
    common = list(QUICK if args.quick else FULL)  # later pairs win: load_config applies them in order
    if args.minutes:
        common += ["--max_minutes", str(args.minutes), "--iterations", "100000"]
    if args.iterations is not None:
        common += ["--iterations", str(args.iterations)]
    common += rest
    names = {k.lstrip("-").replace("-", "_") for k in rest[::2]}
    if names & {"seed", "run_dir"}:
        raise ValueError("flowcredit bench sets --seed and --run_dir itself (use --seeds and --out)")
    cells = []
    for preset in args.presets.split(","):
        cells.append({"name": preset, "preset": preset, "ablation": None, "overrides": common})
        for ablation, extra in (ABLATIONS.get(preset, {}) if args.ablations else {}).items():
            if callable(extra):
                extra = extra(load_config(preset, None, common))
            name = f"{preset}-{ablation}"
            cells.append({"name": name, "preset": preset, "ablation": ablation, "overrides": common + extra})
    return cells


def run_cell(cell: dict, seed: int, runs: Path) -> Path:
    """Train one cell unless its run is finished; returns the run directory."""
    run_dir = runs / f"{cell['name']}-seed{seed}"
    extra = ["--seed", str(seed), "--run_dir", str(run_dir)]
    cfg = load_config(cell["preset"], None, [*cell["overrides"], *extra])
    saved = run_dir / "config.json"
    if saved.exists() and json.loads(saved.read_text()) != dataclasses.asdict(cfg):
        raise ValueError(f"{run_dir} was run with another config; use another --out or delete it")
    if _finished(run_dir, cfg):
        print(f"bench: {run_dir.name}: finished earlier, not recomputed", flush=True)
        return run_dir
    from flowcredit.checkpoint import find_checkpoint
    from flowcredit.train import train

    resume = run_dir.exists() and not cfg.max_minutes and find_checkpoint(run_dir) is not None
    if run_dir.exists() and not resume:
        shutil.rmtree(run_dir)
    print(f"bench: {run_dir.name}: {'resuming' if resume else 'training'}", flush=True)
    t0 = time.time()
    train(cfg, resume=resume)
    (run_dir / "bench.json").write_text(json.dumps({"wall_s": time.time() - t0, "resumed": resume}) + "\n")
    if not _finished(run_dir, cfg):  # SIGINT: train() stopped early; do not count a short run
        raise SystemExit(f"bench: {run_dir.name} was interrupted; run the same command again to resume")
    return run_dir


def _finished(run_dir: Path, cfg: Config) -> bool:
    """The run wrote its summary after its whole budget (not after an early SIGINT stop)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return False
    summary = json.loads(path.read_text())
    return summary["iterations"] >= cfg.iterations or 0 < cfg.max_minutes <= summary["minutes"]


def read_run(run_dir: Path) -> dict:
    """Evaluation points of one run with cumulative seconds and NFE, plus its per-iteration costs."""
    from flowcredit.runlog import read_metrics

    lines = (run_dir / "timings.jsonl").read_text().splitlines()
    secs = {json.loads(x)["iteration"]: json.loads(x)["time/iteration_s"] for x in lines if x.strip()}
    seconds, nfe, points, costs, floor = 0.0, 0, [], [], math.nan
    for m in read_metrics(run_dir):
        it = m["iteration"]
        if it > 0:
            seconds += secs.get(it, math.nan)
            cost = [m.get(f"nfe/{k}", 0) for k in ("rollout", "values", "train")]
            costs.append(cost)
            nfe += sum(cost)
        floor = m.get("eval/test/floor_soft", floor)
        if "eval/test/soft" in m:
            soft, strict = m["eval/test/soft"], m["eval/test/strict"]
            points.append({"iteration": it, "seconds": seconds, "nfe": nfe, "soft": soft, "strict": strict})
    iters = max(len(costs), 1)
    bench = json.loads((run_dir / "bench.json").read_text()) if (run_dir / "bench.json").exists() else {}
    wall = math.nan if bench.get("resumed", True) else bench["wall_s"]  # a resumed run's wall is partial
    nfe_it = [sum(c[k] for c in costs) / iters for k in range(3)]
    out = dict(run_dir=str(run_dir), iterations=len(costs), seconds=seconds, setup_seconds=wall - seconds)
    return out | {"nfe_per_iteration": nfe_it, "noise_floor": floor, "points": points}


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval (NaN for one value)."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)


def mean_curve(runs: list[dict]) -> list[dict]:
    """Seed-mean curve over the evaluation iterations that every seed reached."""
    common = set.intersection(*({p["iteration"] for p in r["points"]} for r in runs))
    out = []
    for it in sorted(common):
        pts = [next(p for p in r["points"] if p["iteration"] == it) for r in runs]
        out.append({k: sum(p[k] for p in pts) / len(pts) for k in ("iteration", "seconds", "nfe", "soft")})
    return out


def _avg(runs: list[dict], f, k: int | None = None) -> float:
    """Seed mean of ``f(run)`` (its ``k``-th entry when given)."""
    return sum(f(r) if k is None else f(r)[k] for r in runs) / len(runs)


def summarise(cells: list[dict], results: dict) -> list[dict]:
    """One row per cell: final scores with CIs, time to reach Flow-GRPO's final mean, costs."""
    fg = results.get("flow_grpo")
    target = ci95([r["points"][-1]["soft"] for r in fg])[0] if fg else math.nan
    rows = []
    for cell in cells:
        runs = results[cell["name"]]
        avg = partial(_avg, runs)
        reach = next((p for p in mean_curve(runs) if p["soft"] >= target), None)
        row = {"name": cell["name"], "seeds": len(runs), "iterations": avg(lambda r: r["iterations"])}
        for key in ("soft", "strict"):
            row[key] = ci95([r["points"][-1][key] for r in runs])
        row |= {
            "start": avg(lambda r: r["points"][0]["soft"]),
            "floor": avg(lambda r: r["noise_floor"]),
            "reach_iteration": reach["iteration"] if reach else None,
            "reach_seconds": reach["seconds"] if reach else None,
            "nfe_per_iteration": [avg(itemgetter("nfe_per_iteration"), k) for k in range(3)],
            "s_per_iteration": avg(lambda r: r["seconds"]) / max(avg(lambda r: r["iterations"]), 1),
            "setup_seconds": avg(lambda r: r["setup_seconds"]),
            "target": target,
        }
        rows.append(row)
    return rows


def _pm(mean_half: tuple[float, float]) -> str:
    mean, half = mean_half
    return f"{mean:.3f} ± {half:.3f}" if math.isfinite(half) else f"{mean:.3f} (one seed)"


def write_table(out: Path, rows: list[dict], settings: dict) -> None:
    target = rows[0]["target"] if rows else math.nan
    lines = [
        "# flowcredit bench",
        "",
        f"Settings: `{json.dumps(settings)}`",
        "",
        "Held-out ShapeEval (ODE, fixed noise): final score, mean ± 95 % t-interval over seeds. "
        f"Reach = first evaluation where the seed-mean soft score ≥ Flow-GRPO's final mean "
        f"({target:.3f}); — if never (or flow_grpo not run). Noise floor = std of the start score over "
        "3 noise seeds. Seconds include evaluation; set-up (model load, ψ calibration, start "
        "evaluation) is apart. NFE = sample·forward passes (CFG counts twice): rollout + values + "
        "update. Per-category bars are not drawn: the trainer logs only the overall score.",
        "",
        "| method | seeds | iterations | soft (final) | strict (final) | soft at start | noise floor "
        "| reach: iteration | reach: seconds | NFE / iteration (rollout+values+update) | s / iteration "
        "| set-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reach_it = "—" if r["reach_iteration"] is None else f"{r['reach_iteration']:.0f}"
        reach_s = "—" if r["reach_seconds"] is None else f"{r['reach_seconds']:.0f}"
        nfe = r["nfe_per_iteration"]
        nfe_s = f"{sum(nfe):,.0f} ({nfe[0]:,.0f}+{nfe[1]:,.0f}+{nfe[2]:,.0f})"
        lines.append(
            f"| {r['name']} | {r['seeds']} | {r['iterations']:.1f} | {_pm(r['soft'])} | {_pm(r['strict'])} "
            f"| {r['start']:.3f} | ±{r['floor']:.3f} | {reach_it} | {reach_s} | {nfe_s} "
            f"| {r['s_per_iteration']:.1f} | {r['setup_seconds']:.0f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")


def write_plots(out: Path, cells: list[dict], results: dict, target: float) -> None:
    """Held-out soft score vs iteration, seconds and NFE: thin lines per seed, thick seed mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"iteration": "iteration", "seconds": "wall-clock seconds", "nfe": "model calls (NFE)"}
    for key, label in labels.items():
        fig, ax = plt.subplots(figsize=(6.5, 4), dpi=110)
        for k, cell in enumerate(cells):
            color = f"C{k % 10}"
            for pts in [r["points"] for r in results[cell["name"]]]:  # each seed, thin
                ax.plot([p[key] for p in pts], [p["soft"] for p in pts], color=color, alpha=0.25, lw=0.8)
            pts = mean_curve(results[cell["name"]])
            ax.plot([p[key] for p in pts], [p["soft"] for p in pts], "o-", color=color, label=cell["name"])
        if math.isfinite(target):
            ax.axhline(target, color="gray", ls="--", lw=0.8, label="Flow-GRPO final mean")
        ax.set(xlabel=label, ylabel="held-out soft score (ODE, fixed noise)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out / f"reward_vs_{key}.png")
        plt.close(fig)


def _json_safe(obj):
    """NaN → null, so that results.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _warm_imports() -> None:
    """Import what every run imports, so that the first cell's set-up time is not charged for it."""
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for name in ("flowcredit.train", "matplotlib.pyplot", "peft", "torch.utils.tensorboard"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    if len(rest) % 2:
        raise SystemExit(f"flowcredit bench: overrides must come as '--field value' pairs, got {rest}")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    cells = plan_cells(args, rest)
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    _warm_imports()
    results = {
        c["name"]: [read_run(run_cell(c, seed, runs)) | {"seed": seed} for seed in seeds] for c in cells
    }
    settings = {"presets": args.presets.split(","), "seeds": seeds, "quick": args.quick}
    settings |= {"ablations": args.ablations, "minutes": args.minutes}
    rows = summarise(cells, results)
    (out / "results.json").write_text(
        json.dumps(
            _json_safe({"settings": settings, "cells": cells, "table": rows, "runs": results}), indent=1
        )
        + "\n"
    )
    write_table(out, rows, settings)
    write_plots(out, cells, results, rows[0]["target"] if rows else math.nan)
    print((out / "table.md").read_text())
    return 0
