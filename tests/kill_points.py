"""Deterministic failures inside the checkpoint write of one iteration (tests/test_resume.py).

``install(point, iteration, how)`` arms a failure at ``point`` while ``Session.save`` writes the
checkpoint of ``iteration``; ``how="raise"`` raises :class:`Killed` (in-process tests), ``how="sigkill"``
kills the process on the spot (no ``finally``, no flush). The points, in the order
``save_checkpoint`` passes them:

- ``after_trainable``: ``checkpoint.tmp`` holds the weights only (the optimizer is being written);
- ``before_swap``: ``checkpoint.tmp`` is complete, ``checkpoint`` is still the previous one;
- ``between_renames``: ``checkpoint`` was moved to ``checkpoint.old``, ``checkpoint.tmp`` not yet renamed;
- ``before_cleanup``: the new ``checkpoint`` is in place, ``checkpoint.old`` not yet removed.

Used from a subprocess: ``python -c "import kill_points; kill_points.run_cli(point, iteration, how, argv)"``.
"""

from __future__ import annotations

import os
import shutil
import signal
import types

import flowcredit.run.checkpoint as checkpoint
import flowcredit.run.session as session

POINTS = ("after_trainable", "before_swap", "between_renames", "before_cleanup")


class Killed(Exception):
    """The injected failure."""


def install(point: str, iteration: int, how: str = "raise", patch=setattr) -> None:
    """Arm the failure; ``patch(module, name, value)`` installs it (a test passes
    ``monkeypatch.setattr``, so it is undone after the test)."""
    if point not in POINTS:
        raise ValueError(f"point must be one of {POINTS}, got {point!r}")
    kill_at = iteration  # (``save`` below takes an ``iteration`` of its own)
    counters = ("save_file", "replace", "rmtree", "fsync")
    calls = {**dict.fromkeys(counters, 0), "armed": False}

    def die():
        calls["armed"] = False
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise Killed(f"killed at {point} of iteration {iteration}'s checkpoint")

    def counted(name, real, fires_at):
        def wrapper(*args, **kwargs):
            if calls["armed"]:
                calls[name] += 1
                if fires_at(calls[name]):
                    die()
            return real(*args, **kwargs)

        return wrapper

    real_save = session.save_checkpoint

    def save(run_dir, *, iteration: int, **kwargs):
        calls.update(dict.fromkeys(counters, 0), armed=iteration == kill_at)
        try:
            return real_save(run_dir, iteration=iteration, **kwargs)
        finally:
            calls["armed"] = False

    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_shutil = types.SimpleNamespace(rmtree=shutil.rmtree)
    fake_os.replace = counted("replace", os.replace, lambda n: point == "between_renames" and n == 2)
    fake_shutil.rmtree = counted("rmtree", shutil.rmtree, lambda n: point == "before_cleanup" and n == 3)
    save_file = counted("save_file", checkpoint.save_file, lambda n: point == "after_trainable" and n == 2)
    fsync = counted("fsync", checkpoint._fsync_dir, lambda n: point == "before_swap")
    for name, value in (
        ("os", fake_os),
        ("shutil", fake_shutil),
        ("save_file", save_file),
        ("_fsync_dir", fsync),
    ):
        patch(checkpoint, name, value)
    patch(session, "save_checkpoint", save)


def run_cli(point: str, iteration: int, how: str, argv: list[str]) -> int:
    """Arm the failure, then run ``flowcredit`` with ``argv``."""
    from flowcredit.cli import main

    install(point, iteration, how)
    return main(argv)


def interrupt_after(iteration: int) -> None:
    """Send this process SIGINT once ``metrics.jsonl`` has its line for ``iteration`` (a user's Ctrl-C
    at a known point)."""
    from flowcredit.run import runlog

    real_log = runlog.RunLog.log

    def log(self, it, metrics, timings=None):
        real_log(self, it, metrics, timings)
        if it == iteration:
            os.kill(os.getpid(), signal.SIGINT)

    runlog.RunLog.log = log
