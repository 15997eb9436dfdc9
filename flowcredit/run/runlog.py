"""Run-directory outputs: ``metrics.jsonl`` (deterministic numbers only), ``timings.jsonl`` (wall
clock), a tracker (``log_with``: TensorBoard events in ``run_dir/tb``, or Weights & Biases), the
reward-curve PNG, image grids and the end-of-run summary.

The JSONL files are always written: resume and the bench read them. ``timings.jsonl`` also keeps the
run's clock, ``time/run_s``: the seconds of training so far over every process of a resumed run
(:meth:`RunLog.elapsed`); checkpoints stay free of wall-clock numbers, so that a resumed run's equal an
uninterrupted one's byte for byte. Trackers are accelerate's
(``accelerate.tracking``); wandb is the optional extra ``flowcredit[wandb]`` and runs offline with
``WANDB_MODE=offline`` (its files under ``run_dir/wandb``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from pathlib import Path

WANDB_ID = "wandb_id.txt"
PROVENANCE = "provenance.jsonl"


def provenance(iteration: int, threads: int, device: str = "cpu") -> dict:
    """Where and with what a run (re)starts at ``iteration`` on ``device``: its name (the GPU's model
    on a CUDA device, else the CPU's model string), torch's version, the torch threads, the library's
    git commit (None outside a git checkout; ``dirty``: uncommitted changes under flowcredit/) and
    the UTC time."""
    import platform
    import subprocess
    import time

    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(device))
    else:
        name = platform.processor() or platform.machine()
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            name = next(ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name"))
        except (OSError, StopIteration):
            pass
    source = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            argv = ["git", "-C", str(source), *args]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", "flowcredit")) if commit else None
    return {
        "iteration": iteration,
        "device": name,
        "torch": torch.__version__,
        "threads": threads or torch.get_num_threads(),
        "commit": commit,
        "dirty": dirty,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def make_tracker(log_with: str, run_dir: Path, config: dict | None):
    """accelerate's tracker for ``log_with`` (None for ``"none"``), started; the config goes to wandb.

    A resumed run continues its wandb run (the id is kept in ``run_dir/wandb_id.txt``)."""
    if log_with == "none":
        return None
    from accelerate import PartialState

    PartialState()  # accelerate's trackers log through its state (set up already under several processes)
    if log_with == "tensorboard":
        from accelerate.tracking import TensorBoardTracker

        tracker = TensorBoardTracker("tb", str(run_dir))
        tracker.start()
        return tracker
    from accelerate.tracking import WandBTracker

    from flowcredit.errors import UserError

    if importlib.util.find_spec("wandb") is None:
        raise UserError("log_with='wandb' needs wandb: pip install 'flowcredit[wandb]'")
    id_file = run_dir / WANDB_ID
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:8] + "\n")  # a wandb run id, kept for resuming
    project = os.environ.get("WANDB_PROJECT", "flowcredit")
    tracker = WandBTracker(
        project, dir=str(run_dir), name=run_dir.name, id=id_file.read_text().strip(), resume="allow"
    )
    tracker.start()
    if config is not None:
        tracker.store_init_configuration(config)
    return tracker


class RunLog:
    """Appends namespaced metrics (``reward/mean``, ``loss/policy``, ``stats/clipfrac``, ``eval/…``)
    to the JSONL files and to the tracker, and keeps the run's clock (:meth:`elapsed`)."""

    def __init__(
        self,
        run_dir: Path,
        resume_iteration: int | None = None,
        log_with: str = "tensorboard",
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.timings_path = self.run_dir / "timings.jsonl"
        if resume_iteration is not None:  # drop lines written after the checkpoint we resume from
            for path in (self.metrics_path, self.timings_path):
                _truncate_after(path, resume_iteration)
        self.started = time.time()
        self.seconds_before = earlier_seconds(self.timings_path) if resume_iteration is not None else 0.0
        self.tracker = make_tracker(log_with, self.run_dir, config)
        with open(self.run_dir / PROVENANCE, "a") as fh:  # one line per start or resume
            cfg = config or {}
            where = provenance(resume_iteration or 0, cfg.get("threads", 0), cfg.get("device", "cpu"))
            fh.write(json.dumps(where, sort_keys=True) + "\n")

    @property
    def wants_images(self) -> bool:
        """Whether the tracker takes the evaluation grids (wandb does; TensorBoard gets scalars only)."""
        return self.tracker is not None and self.tracker.name == "wandb"

    def elapsed(self) -> float:
        """Seconds of training of the whole run: this process's since the log opened, plus the earlier
        processes' up to the iteration it resumed from (:func:`earlier_seconds`)."""
        return self.seconds_before + time.time() - self.started

    def log(self, iteration: int, metrics: dict, timings: dict | None = None) -> None:
        """One ``metrics.jsonl`` line; with ``timings``, one ``timings.jsonl`` line with ``time/run_s``."""
        if timings:
            timings = {**timings, "time/run_s": self.elapsed()}
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps({"iteration": iteration, **metrics}, sort_keys=True) + "\n")
        if timings:
            with open(self.timings_path, "a") as fh:
                fh.write(json.dumps({"iteration": iteration, **timings}, sort_keys=True) + "\n")
        if self.tracker is not None:
            scalars = {k: v for k, v in {**metrics, **(timings or {})}.items() if isinstance(v, (int, float))}
            self.tracker.log(scalars, step=iteration)

    def log_images(self, iteration: int, grids: dict) -> None:
        """``{"eval/<set>": PIL image}`` to the tracker, if it takes images."""
        if grids and self.wants_images:
            self.tracker.log_images({k: [v] for k, v in grids.items()}, step=iteration)

    def close(self) -> None:
        if self.tracker is not None:
            self.tracker.finish()


def _truncate_after(path: Path, iteration: int) -> None:
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["iteration"] <= iteration]
    path.write_text("".join(ln + "\n" for ln in kept))


def earlier_seconds(timings_path: Path) -> float:
    """The run's clock at the last line of ``timings.jsonl`` (``time/run_s``); a run from before that
    key: the sum of its iterations' seconds (which leaves out its start-up evaluation); 0 without lines."""
    if not timings_path.exists():
        return 0.0
    rows = [json.loads(ln) for ln in timings_path.read_text().splitlines() if ln.strip()]
    if rows and "time/run_s" in rows[-1]:
        return float(rows[-1]["time/run_s"])
    return float(sum(row.get("time/iteration_s", 0.0) for row in rows))


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def read_iteration_seconds(run_dir: Path) -> dict[int, float]:
    """``timings.jsonl`` as ``{iteration: seconds}`` (the last time logged for an iteration counts: a
    resume may log one twice)."""
    lines = (Path(run_dir) / "timings.jsonl").read_text().splitlines()
    rows = [json.loads(ln) for ln in lines if ln.strip()]
    return {row["iteration"]: row["time/iteration_s"] for row in rows}


def plot_curves(run_dir: Path) -> Path:
    """``reward_curve.png``: training reward per iteration and evaluation scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    train = [(r["iteration"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    evals = [(r["iteration"], r["eval/test/soft"]) for r in rows if "eval/test/soft" in r]
    evals_train = [(r["iteration"], r["eval/train/soft"]) for r in rows if "eval/train/soft" in r]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    if train:
        ax.plot(*zip(*train), label="training reward (SDE rollouts)", alpha=0.6)
    if evals_train:
        ax.plot(*zip(*evals_train), "o-", label="eval: trained prompts (ODE, fixed noise)")
    if evals:
        ax.plot(*zip(*evals), "s-", label="eval: held-out prompts (ODE, fixed noise)")
    alarms = [r["iteration"] for r in rows if r.get("guard/alarm")]
    for k, it in enumerate(alarms):  # the reward-hacking guard's alarms (docs/guard.md)
        ax.axvline(it, color="red", ls="--", lw=0.8, alpha=0.7, label="guard alarm" if k == 0 else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("ShapeEval soft score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "reward_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out
