"""Run-directory outputs: ``metrics.jsonl`` (deterministic numbers only), ``timings.jsonl`` (wall
clock), TensorBoard events, the reward-curve PNG, image grids and the end-of-run summary."""

from __future__ import annotations

import json
from pathlib import Path


class RunLog:
    """Appends namespaced metrics (``reward/mean``, ``loss/policy``, ``stats/clipfrac``, ``eval/…``)."""

    def __init__(self, run_dir: Path, resume_iteration: int | None = None):
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.timings_path = self.run_dir / "timings.jsonl"
        if resume_iteration is not None:  # drop lines written after the checkpoint we resume from
            for path in (self.metrics_path, self.timings_path):
                _truncate_after(path, resume_iteration)
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tb"))
        except ImportError:  # tensorboard is a declared dependency; keep running without it anyway
            self.writer = None

    def log(self, iteration: int, metrics: dict, timings: dict | None = None) -> None:
        with open(self.metrics_path, "a") as fh:
            fh.write(json.dumps({"iteration": iteration, **metrics}, sort_keys=True) + "\n")
        if timings:
            with open(self.timings_path, "a") as fh:
                fh.write(json.dumps({"iteration": iteration, **timings}, sort_keys=True) + "\n")
        if self.writer is not None:
            for key, value in {**metrics, **(timings or {})}.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, iteration)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _truncate_after(path: Path, iteration: int) -> None:
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["iteration"] <= iteration]
    path.write_text("".join(ln + "\n" for ln in kept))


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


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
    ax.set_xlabel("iteration")
    ax.set_ylabel("ShapeEval soft score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "reward_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out
