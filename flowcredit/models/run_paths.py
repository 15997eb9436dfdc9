"""A ``--checkpoint`` that points into a training run instead of at a model: the run folder itself,
its training state (``checkpoint/``, for ``--resume``) or a misspelt ``final/``. Each is named with
the path to give instead, for a one-line :class:`~flowcredit.errors.ConfigError` of the loader."""

from __future__ import annotations

from pathlib import Path

STATE_DIRS = ("checkpoint", "checkpoint.old")
"""A run's training state (trainable weights, optimizer, EMA): what ``flowcredit train --resume`` reads."""


def is_run_dir(path: Path) -> bool:
    """A training run's folder: its ``config.json`` beside ``final/`` or a training-state folder."""
    return (path / "config.json").is_file() and any((path / d).is_dir() for d in ("final", *STATE_DIRS))


def _run_dir_problem(checkpoint: str, path: Path) -> str:
    final = path / "final"
    if final.is_dir():
        return f"{checkpoint!r} is a run folder, not a model; give --checkpoint {final} (its trained model)"
    return (
        f"{checkpoint!r} is a run folder without final/ (the run has not finished); "
        f"finish it with 'flowcredit train --resume {checkpoint}'"
    )


def _misspelt_problem(checkpoint: str, final: Path) -> str:
    if final.is_dir():
        return f"no such directory {checkpoint!r}: did you mean {str(final)!r} (the run's trained model)?"
    return f"no such directory {checkpoint!r}; {_run_dir_problem(str(final.parent), final.parent)}"


def run_path_problem(checkpoint: str) -> str | None:
    """What is wrong with ``checkpoint`` if it is a run folder, a run's training state or a missing
    path beside a run's ``final/`` (a typo), and what to give instead; None for any other path."""
    path = Path(checkpoint).expanduser()
    if is_run_dir(path):
        return _run_dir_problem(checkpoint, path)
    run, final = path.parent, path.parent / "final"
    if path.name in STATE_DIRS and is_run_dir(run):
        return (
            f"{checkpoint!r} is a run's training state (for 'flowcredit train --resume {run}'), "
            f"not a model; give --checkpoint {final} (its trained model)"
        )
    if not path.exists() and is_run_dir(run):
        return _misspelt_problem(checkpoint, final)
    return None
