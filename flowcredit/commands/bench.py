"""``flowcredit bench``: credit-assignment methods compared on the built-in task with equal budgets.

Each cell (a preset, or a preset with one ablation, × a seed) is one ``flowcredit.train.train`` run in
``OUT/runs/<cell>-seed<k>``: same iterations (``--iterations``) or same wall clock (``--minutes`` →
``max_minutes``), same held-out prompts, evaluation interval and fixed evaluation noise. A finished
run (``summary.json`` after its whole budget) is read, not recomputed; an interrupted one resumes
from its checkpoint (a wall-clock cell restarts, so that its budget stays whole); a run whose config
differs from the requested one is an error, never mixed in. Outputs: ``OUT/results.json`` (every
evaluation point with iteration, seconds from ``timings.jsonl``, cumulative NFE from
``metrics.jsonl``), ``OUT/table.md``, score vs iteration / seconds / NFE plots and held-out
per-category bars (``flowcredit.commands.bench_report``). Honesty notes: 1) seconds are the trainer's
per-iteration wall clock, evaluation included (the same for every method); set-up (model load,
DenseGRPO's ψ calibration, start evaluation) is reported apart. 2) NFE counts training calls only
(rollout + values + update), not calibration or evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from flowcredit.cli_args import ArgParser, add_config_fields
from flowcredit.commands.bench_read import json_safe, read_run
from flowcredit.commands.bench_report import write_plots, write_table
from flowcredit.commands.bench_skill import after_run, published, relative_paths, score_published
from flowcredit.commands.bench_stats import report
from flowcredit.commands.bench_tasks import (
    ABLATIONS,
    CHEAP,
    QUICK,
    TASKS,
)
from flowcredit.config import Config
from flowcredit.errors import UserError
from flowcredit.presets import COMPARED_PRESETS, load_config


def _parser() -> ArgParser:
    doc = (
        "Compare credit methods (presets × seeds, equal budgets). The config fields below override every "
        "run's config, after the task's settings; --seed and --run_dir are the bench's own (--seeds, --out)."
    )
    p = ArgParser(prog="flowcredit bench", description=doc)
    p.add_argument("--presets", default=",".join(COMPARED_PRESETS), help="comma list of presets to compare")
    p.add_argument("--task", default="demo", choices=sorted(TASKS), help="settings shared by every cell")
    p.add_argument("--seeds", default=None, help="comma list (default 0,1,2; --quick: 0)")
    p.add_argument("--iterations", type=int, default=None, help="iterations per run (default: the task's)")
    p.add_argument("--minutes", type=float, default=0.0, help="equal wall-clock budget per run instead")
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--quick", action="store_true", help="tiny settings that finish in a few minutes")
    p.add_argument(
        "--ablations",
        nargs="?",
        const="all",
        default="",
        help="add the ablations of the selected presets (all, or a comma list of their names)",
    )
    p.add_argument("--no_cheap", action="store_true", help="without the one-step-value rows (CHEAP)")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at once, each its own process (GPU: several; on the CPU each gets threads // jobs)",
    )
    p.add_argument("--report_only", action="store_true", help="only read the finished runs under --out")
    p.add_argument("--publish", default=None, help="copy each finished run's small JSON here (e.g. into git)")
    p.add_argument(
        "--score_confirm",
        action="store_true",
        help="--task skill: score the runs published in --publish with their weights on the confirmation "
        "set (and the base), training nothing",
    )
    add_config_fields(p, skip=("seed", "run_dir"))
    return p


def plan_cells(args, rest: list[str]) -> list[dict]:
    """``[{name, preset, ablation, overrides}]``; overrides are ``--key value`` strings."""
    common = TASKS[args.task]() + (QUICK if args.quick else [])  # later pairs win (applied in order)
    if args.minutes:
        common += ["--max_minutes", str(args.minutes), "--iterations", "100000"]
    if args.iterations is not None:
        common += ["--iterations", str(args.iterations)]
    common += rest
    taken = [k for k in rest[::2] if k.lstrip("-").replace("-", "_") in ("seed", "run_dir")]
    if taken:
        raise UserError(f"{taken[0]} is set by the bench for every run (use --seeds and --out)")
    cells = []
    for preset in args.presets.split(","):
        cells.append({"name": preset, "preset": preset, "ablation": None, "overrides": common})
        variants = {} if getattr(args, "no_cheap", False) else dict(CHEAP.get(preset, {}))
        wanted = {"all"} if args.ablations is True else set(filter(None, str(args.ablations).split(",")))
        variants |= {k: v for k, v in ABLATIONS.get(preset, {}).items() if wanted & {"all", k}}
        for ablation, extra in variants.items():
            if callable(extra):
                extra = extra(load_config(preset, None, common))
            name = f"{preset}-{ablation}"
            cells.append({"name": name, "preset": preset, "ablation": ablation, "overrides": common + extra})
    if args.task == "skill":  # the EMA weights at half the run too, for later evaluations (issue 56)
        for cell in cells:
            iterations = load_config(cell["preset"], None, cell["overrides"]).iterations
            cell["overrides"] = [*cell["overrides"], "--snapshot_every", str(max(1, iterations // 2))]
    if args.jobs > 1 and "threads" not in {k.lstrip("-").replace("-", "_") for k in rest[::2]}:
        cells = [_split_threads(cell, args.jobs) for cell in cells]
    return cells


def _split_threads(cell: dict, jobs: int) -> dict:
    """A CPU run among ``jobs`` at once gets ``threads // jobs`` torch threads (at least 1) unless
    ``--threads`` is given: N runs of 2 threads each on 2 cores spin against each other (measured here:
    the test's two one-iteration runs took 48 s of CPU at 2 threads each, 30 s at 1)."""
    cfg = load_config(cell["preset"], None, cell["overrides"])
    if cfg.device != "cpu":
        return cell
    return cell | {"overrides": [*cell["overrides"], "--threads", str(max(1, cfg.threads // jobs))]}


def plan_run(cell: dict, seed: int, runs: Path) -> tuple[Path, Config, str]:
    """``(run_dir, cfg, action)`` of one run; action: ``"done"`` (finished earlier, read only),
    ``"resume"`` (an interrupted run with a checkpoint) or ``"train"`` (from scratch)."""
    run_dir = runs / f"{cell['name']}-seed{seed}"
    extra = ["--seed", str(seed), "--run_dir", str(run_dir)]
    cfg = load_config(cell["preset"], None, [*cell["overrides"], *extra])
    saved = run_dir / "config.json"
    if saved.exists() and not same_settings(json.loads(saved.read_text()), dataclasses.asdict(cfg)):
        raise UserError(f"{run_dir} was run with another config; use another --out or delete it")
    if _finished(run_dir, cfg):
        return run_dir, cfg, "done"
    from flowcredit.run.checkpoint import find_checkpoint

    resume = run_dir.exists() and not cfg.max_minutes and find_checkpoint(run_dir) is not None
    return run_dir, cfg, "resume" if resume else "train"


def same_settings(saved: dict, now: dict) -> bool:
    """Whether a run's saved config is ``now`` apart from its location (a grid moved to another
    directory or clone still resumes) and from fields added since it was written that hold their
    default (the behaviour it ran with)."""
    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    added = {k for k in now if k not in saved and now[k] == defaults.get(k, object())}
    drop = {"run_dir", *added}
    return {k: v for k, v in saved.items() if k not in drop} == {
        k: v for k, v in now.items() if k not in drop
    }


def run_cell(cell: dict, seed: int, runs: Path) -> Path:
    """Train one cell in this process unless its run is finished; returns the run directory."""
    run_dir, cfg, action = plan_run(cell, seed, runs)
    if action == "done":
        print(f"bench: {run_dir.name}: finished earlier, not recomputed", flush=True)
        return run_dir
    from flowcredit.train import train

    if run_dir.exists() and action == "train":
        shutil.rmtree(run_dir)
    print(f"bench: {run_dir.name}: {'resuming' if action == 'resume' else 'training'}", flush=True)
    t0 = time.time()
    train(cfg, resume=action == "resume")
    _finish_run(run_dir, cfg, time.time() - t0, action == "resume")
    return run_dir


def run_in_process(cell: dict, seed: int, runs: Path) -> Path:
    """The same as :func:`run_cell` in a child process (``--jobs``: several runs share a GPU)."""
    run_dir, cfg, action = plan_run(cell, seed, runs)
    if action == "done":
        return run_dir
    if run_dir.exists() and action == "train":
        shutil.rmtree(run_dir)
    argv = ["--resume", str(run_dir)] if action == "resume" else ["--preset", cell["preset"]]
    argv += [*cell["overrides"], "--seed", str(seed), "--run_dir", str(run_dir)]
    log = runs / f"{run_dir.name}.log"
    t0 = time.time()
    with open(log, "w") as fh:
        code = subprocess.call([sys.executable, "-m", "flowcredit", "train", *argv], stdout=fh, stderr=fh)
    if code:
        raise SystemExit(f"bench: {run_dir.name} failed (exit {code}); see {log}")
    _finish_run(run_dir, cfg, time.time() - t0, action == "resume")
    print(f"bench: {run_dir.name}: done in {time.time() - t0:.0f} s", flush=True)
    return run_dir


def _finish_run(run_dir: Path, cfg: Config, wall: float, resumed: bool) -> None:
    (run_dir / "bench.json").write_text(json.dumps({"wall_s": wall, "resumed": resumed}) + "\n")
    if not _finished(run_dir, cfg):  # SIGINT: train() stopped early; do not count a short run
        raise SystemExit(f"bench: {run_dir.name} was interrupted; run the same command again to resume")


CALIBRATION_FIELDS = (
    *("model", "checkpoint", "resolution", "dtype", "guidance_scale", "device", "reward", "reward_options"),
    *("train_prompts", "num_train_prompts", "num_steps", "shift", "window_start", "window_size"),
    *("group_size", "batch_size", "train_params", "lora_rank", "lora_alpha", "lora_targets"),
)
"""The config fields ψ's calibration reads (besides the ``calib_*`` ones); cells sharing one ψ must
agree on them."""


def _calibration_key(cfg: Config) -> tuple:
    fields = dataclasses.asdict(cfg)
    return tuple(
        (k, v) for k, v in sorted(fields.items()) if k in CALIBRATION_FIELDS or k.startswith("calib_")
    )


def shared_psi(cells: list[dict], out: Path) -> list[dict]:
    """Calibrate ψ once for the cells that calibrate (seed 0) and hand it to them as ``psi_path``: one
    ψ per task and model, reused across seeds and by the cells' variants (another value estimator, say);
    its wall time is reported apart (``OUT/psi/bench.json``). Cells whose calibrations would differ are
    an error."""
    configs = {c["name"]: load_config(c["preset"], None, c["overrides"]) for c in cells}
    calibrating = [c for c in cells if configs[c["name"]].calibrate]
    if not calibrating:
        return cells
    keys = {_calibration_key(configs[c["name"]]) for c in calibrating}
    if len(keys) > 1:
        raise UserError("bench: the cells that calibrate ψ would calibrate differently; bench them apart")
    psi_dir, first = out / "psi", calibrating[0]
    if not (psi_dir / "psi.json").is_file():
        shutil.rmtree(psi_dir, ignore_errors=True)
        from flowcredit.commands import calibrate

        t0 = time.time()
        calibrate.main(["--preset", first["preset"], *first["overrides"], "--run_dir", str(psi_dir)])
        (psi_dir / "bench.json").write_text(json.dumps({"wall_s": time.time() - t0}) + "\n")
    use = ["--calibrate", "false", "--psi_path", str(psi_dir / "psi.json")]
    return [c | {"overrides": c["overrides"] + use} if c in calibrating else c for c in cells]


def _finished(run_dir: Path, cfg: Config) -> bool:
    """The run wrote its summary after its whole budget (not after an early SIGINT stop)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return False
    summary = json.loads(path.read_text())
    return summary["iterations"] >= cfg.iterations or 0 < cfg.max_minutes <= summary["minutes"]


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


def score_confirm(args, cells: list[dict], out: Path) -> int:
    """``--score_confirm``: the published runs' confirmation evaluations from their weights
    (:func:`flowcredit.commands.bench_skill_eval.score_published`), on the first cell's device."""
    if args.task != "skill" or not args.publish:
        raise UserError(
            "bench: --score_confirm scores the skill bench's published runs: give --task skill --publish DIR"
        )
    cfg = load_config(cells[0]["preset"], None, cells[0]["overrides"])
    done = score_published(Path(args.publish), out / "scored", cfg)
    print(f"bench: {len(done)} published record(s) scored on the confirmation set: {[p.stem for p in done]}")
    return 0


def run_all(args, jobs: list[tuple[dict, int]], runs: Path, after) -> dict:
    """``{(cell name, seed): run_dir}`` of every job, trained here (or in ``--jobs`` processes) unless
    finished earlier, under a progress bar over the runs, labelled with the cell and seed started last."""
    from tqdm import tqdm

    run = run_in_process if args.jobs > 1 else run_cell
    with tqdm(total=len(jobs), desc="bench", unit="run", dynamic_ncols=True) as bar:

        def one(job: tuple[dict, int]) -> Path:
            bar.set_description(f"bench {job[0]['name']} seed {job[1]}")
            run_dir = after(run(*job, runs))
            bar.update()
            return run_dir

        if args.jobs > 1:
            with ThreadPoolExecutor(args.jobs) as pool:
                dirs = list(pool.map(one, jobs))
        else:  # in this thread: train() handles SIGINT, which only the main thread receives
            _warm_imports()
            dirs = [one(job) for job in jobs]
    return {(c["name"], s): d for (c, s), d in zip(jobs, dirs)}


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_with_overrides(argv)
    if len(rest) % 2:
        raise UserError(f"overrides must come as '--field value' pairs, got {rest}")
    seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    cells = plan_cells(args, rest)  # before any directory is made: a refused flag leaves nothing behind
    out = Path(args.out)
    runs = out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    if args.score_confirm:
        return score_confirm(args, cells, out)
    if not args.report_only or (out / "psi" / "psi.json").is_file():  # report: name the ψ that was used
        cells = shared_psi(cells, out)
    jobs = [(c, seed) for seed in seeds for c in cells]  # seed-major: early seeds of every cell first
    if args.publish and not args.report_only:  # finished and published earlier (maybe in another clone)
        jobs = [(c, seed) for c, seed in jobs if not published(Path(args.publish), c, seed)]
    after = after_run(args, cells, out)
    if args.report_only:
        done = {(c["name"], s): runs / f"{c['name']}-seed{s}" for c, s in jobs}
        done = {k: d for k, d in done.items() if (d / "summary.json").is_file()}
    else:
        done = run_all(args, jobs, runs, after)
    results = {
        c["name"]: [read_run(done[c["name"], s]) | {"seed": s} for s in seeds if (c["name"], s) in done]
        for c in cells
    }
    results = {name: r for name, r in results.items() if r}
    cells = [c for c in cells if c["name"] in results]
    settings = {"task": args.task, "presets": args.presets.split(","), "seeds": seeds, "quick": args.quick}
    settings |= {"ablations": args.ablations, "minutes": args.minutes, "jobs": args.jobs}
    if (out / "psi" / "bench.json").is_file():
        settings["psi_calibration_s"] = json.loads((out / "psi" / "bench.json").read_text())["wall_s"]
    rep = report(cells, results)
    rows = rep["table"]
    data = {
        "settings": settings,
        "cells": cells,
        "table": rows,
        "paired": rep["paired"],
        "variants": rep["variants"],
    }
    data |= {"claims": rep["claims"], "runs": results}
    data = relative_paths(relative_paths(json_safe(data), out / "runs"), Path.cwd())  # read elsewhere too
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    write_table(out, rows, settings, results)
    write_plots(out, cells, results, rows)
    print((out / "table.md").read_text())
    return 0
