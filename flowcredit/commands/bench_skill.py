"""The ``skill`` comparison of ``flowcredit bench`` (``--task skill``): its arms, its compute
accounting and its final held-out evaluation.

Every arm is the ``skill`` preset with one change (:data:`SKILL_ARMS`); seeds pair the arms (same
prompt draws and initial noise per seed). After a run finishes, its exported weights (``final/``, the
EMA) are evaluated on all 86 held-out prompts × 16 samples × the noise seeds :data:`FINAL_EVAL_SEEDS`,
which no choice of this library ever looked at (the recipes were chosen on 100–103 and 1234), and on
the confirmation set (:mod:`flowcredit.commands.bench_skill_eval`), the base checkpoint once the same
way; the small JSON of each (``summary.json`` + the evaluations' per-sample scores) is copied to
``--publish`` so that finished runs land in git as they finish.
The report on the published runs (held-out scores, paired differences, verdicts) is
:mod:`flowcredit.commands.bench_skill_report`, re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from flowcredit.commands.bench_skill_arms import (  # noqa: F401 (the arms and their costs, re-exported)
    SKILL_ARMS,
    _equal_nfe,
    nfe_parts,
    nominal_calls,
    nominal_nfe,
    rollout_calls,
    trained_per_row,
)
from flowcredit.commands.bench_skill_eval import (  # noqa: F401 (the evaluations, re-exported)
    CONFIRM_DIR,
    FINAL_EVAL_SAMPLES,
    FINAL_EVAL_SEEDS,
    base_eval,
    base_published,
    final_eval,
    relative_paths,
    score_published,
)
from flowcredit.commands.bench_skill_report import (  # noqa: F401 (the report, re-exported)
    EQUIVALENCE,
    SKILL_CLAIMS,
    VERDICT_METRICS,
    arm_verdict,
    heldout_scores,
    skill_report,
    skill_verdict,
)
from flowcredit.config import Config
from flowcredit.errors import UserError
from flowcredit.presets import load_config
from flowcredit.run.runlog import PROVENANCE, read_iteration_seconds, read_metrics


def training_curve(rows: list[dict]) -> dict[str, list[float]]:
    """The training reward per iteration and the network calls spent up to it, from ``metrics.jsonl``'s
    rows: ``{"iteration": [...], "reward": [...], "nfe": [...]}`` (``nfe``: cumulative rollout +
    update + value calls, so arms can be set side by side at equal compute)."""
    train = [r for r in rows if "reward/mean" in r]
    nfe, total = [], 0
    for r in train:
        total += r["nfe/rollout"] + r["nfe/train"] + r["nfe/values"]
        nfe.append(total)
    iterations, rewards = [r["iteration"] for r in train], [r["reward/mean"] for r in train]
    return {"iteration": iterations, "reward": rewards, "nfe": nfe}


def training_minutes(run_dir: Path) -> float:
    """Minutes of training summed over the iterations of ``timings.jsonl`` (the last time logged for an
    iteration counts, as a resume may log one twice): a resumed run's whole cost, without its
    evaluations and set-up. ``summary.json``'s minutes count only the process that finished the run."""
    return sum(read_iteration_seconds(run_dir).values()) / 60


def publish(run_dir: Path, dest: Path) -> Path:
    """Copy the run's small results (config, summary, held-out and confirmation per-sample scores,
    training curve) to ``dest/<run>.json``."""
    record = {"run": run_dir.name}
    files = {"config": "config.json", "summary": "summary.json", "heldout": "heldout/eval.json"}
    if not (run_dir / "config.json").is_file():  # the base checkpoint's evaluation directory
        files = {"heldout": "eval.json"}
    files["confirm"] = f"{CONFIRM_DIR}/eval.json"
    for name, path in files.items():
        if (run_dir / path).is_file():
            record[name] = json.loads((run_dir / path).read_text())
    if rows := read_metrics(run_dir):
        record["curve"] = training_curve(rows)
    if (run_dir / "timings.jsonl").is_file():  # every iteration's time, resumed parts included
        record["train_minutes"] = training_minutes(run_dir)
    calibrated = run_dir / "calibration.json"  # ψ's calibration: its rounds are part of the run's cost
    shared = not calibrated.is_file() and record.get("config", {}).get("psi_path")
    if shared:  # the bench calibrates ψ once for the cells that would calibrate alike (bench.shared_psi)
        calibrated = Path(record["config"]["psi_path"]).parent / "calibration.json"
    if calibrated.is_file():
        calibration = json.loads(calibrated.read_text())
        record["calibration"] = {k: calibration[k] for k in ("iterations", "converged", "psi")}
        record["calibration"]["shared"] = bool(shared)
    if (run_dir / PROVENANCE).is_file():  # where each start or resume of the run ran
        lines = (run_dir / PROVENANCE).read_text().splitlines()
        record["provenance"] = [json.loads(ln) for ln in lines if ln.strip()]
    record = relative_paths(record, run_dir.parent)
    dest.mkdir(parents=True, exist_ok=True)
    publish_weights(run_dir, dest / run_dir.name)
    target = dest / f"{run_dir.name}.json"
    target.write_text(json.dumps(record) + "\n")
    return target


def publish_weights(run_dir: Path, dest: Path) -> list[Path]:
    """Copy the run's trained tensors (the EMA weights: ``final/`` and every ``snapshots/iteration-K``,
    ``trainable.safetensors`` only, about 270 KB each on the built-in model) and its ``config.json`` to
    ``dest/final``, ``dest/iteration-K`` and ``dest/config.json``: ``flowcredit eval --config
    dest/config.json`` (or ``--checkpoint dest/iteration-K``) evaluates them again without retraining.
    Returns the weight files written (none for a run without ``final/``)."""
    sources = [run_dir / "final", *sorted((run_dir / "snapshots").glob("iteration-*"))]
    sources = [p for p in sources if (p / "trainable.safetensors").is_file()]
    written = []
    for source in sources:
        target = dest / source.name
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / "trainable.safetensors.tmp"
        shutil.copyfile(source / "trainable.safetensors", tmp)
        tmp.replace(target / "trainable.safetensors")
        written.append(target / "trainable.safetensors")
    if written:
        config = relative_paths(json.loads((run_dir / "config.json").read_text()), run_dir.parent)
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


# --- what the bench does around each run ---------------------------------------------------------


def published(dest: Path, cell: dict, seed: int) -> bool:
    """``dest/<run>.json`` holds the whole run and its held-out evaluation: nothing to train again."""
    path = dest / f"{cell['name']}-seed{seed}.json"
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    iterations = load_config(cell["preset"], None, cell["overrides"]).iterations
    done = record.get("summary", {}).get("iterations", 0) >= iterations and "heldout" in record
    if done:
        _same_psi(record, cell, path)
        print(f"bench: {path.stem}: published earlier in {dest}, not recomputed", flush=True)
    return done


def _same_psi(record: dict, cell: dict, path: Path) -> None:
    """A published run that trained with a calibrated ψ must have used the ψ this bench hands to its new
    runs (``--psi_path``, from bench.shared_psi): on a fresh machine ψ is calibrated again, and seeds
    trained with another ψ would not be seeds of one arm."""
    overrides, used = cell["overrides"], record.get("calibration", {}).get("psi")
    if used is None or "--psi_path" not in overrides:
        return
    psi_path = Path(overrides[overrides.index("--psi_path") + 1])
    psi = json.loads(psi_path.read_text())["psi"]
    if psi != used:
        raise UserError(
            f"bench: {path} trained with ψ {used}, but this bench calibrated ψ {psi} ({psi_path}); "
            "new runs would not be seeds of the same arm: write the published ψ into that file, or "
            "move the published runs aside and rerun the arm"
        )


def after_run(args, cells: list[dict], out: Path):
    """What follows each finished run: the ``skill`` task's evaluations on both sets (of the base
    checkpoint first, once; the base and the runs published with their weights but without the
    confirmation set get it first: :func:`score_published`), then ``--publish``. Returns
    ``run_dir -> run_dir``."""
    publish_to = Path(args.publish) if args.publish else None
    cfg = load_config(cells[0]["preset"], None, cells[0]["overrides"]) if args.task == "skill" else None
    if cfg and not args.report_only and not base_published(publish_to, args.quick):
        base = base_eval(cfg, out / "base-heldout", cfg.threads, args.quick).parent
        if publish_to:
            publish(base, publish_to)
    if cfg and not args.report_only and publish_to and not args.quick:
        score_published(publish_to, out / "scored", cfg)

    def after(run_dir: Path) -> Path:
        if args.task == "skill":
            threads = json.loads((run_dir / "config.json").read_text())["threads"]
            final_eval(run_dir, threads, args.quick)
        if publish_to:
            publish(run_dir, publish_to)
        return run_dir

    return after


def run_cost(record: dict) -> dict[str, float]:
    """One published run's cost: ``train_nfe`` (rollout + values + update calls logged over its
    iterations), ``calibration_nfe`` (ψ's calibration rounds × ``calib_groups`` × ``group_size``
    trajectories × their rollout + value calls, from the config), ``nfe_per_iteration`` and
    ``cpu_minutes`` (training minutes × threads, from ``train_minutes`` where the record has it, else
    the summary's minutes, which miss the parts before a resume; inflated when other work shared the
    CPU)."""
    cfg = Config(
        **{k: v for k, v in record["config"].items() if k in {f.name for f in dataclasses.fields(Config)}}
    )
    curve = record.get("curve", {})
    train = curve["nfe"][-1] if curve.get("nfe") else float("nan")
    rounds = record.get("calibration", {}).get("iterations", 0)
    parts = nfe_parts(cfg)
    calibration = rounds * cfg.calib_groups * cfg.group_size * (parts["rollout"] + parts["values"])
    iterations = len(curve.get("nfe", ())) or float("nan")
    minutes = record.get("train_minutes", record.get("summary", {}).get("minutes", float("nan")))
    return {
        "train_nfe": train,
        "calibration_nfe": float(calibration),
        "nfe_per_iteration": train / iterations,
        "cpu_minutes": minutes * cfg.threads,
    }
