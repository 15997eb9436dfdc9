"""Progress bars of the long loops outside training (``flowcredit eval``, DenseGRPO's calibration)."""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_S = 30.0
"""Seconds between redraws when stderr is not a terminal: a log file gets a line per half minute."""


def progress_bar(total: int, desc: str, unit: str = "it", enabled: bool = True) -> tqdm:
    """A tqdm bar of ``total`` steps on stderr (stdout keeps the tables), labelled ``desc``; a no-op
    bar when not ``enabled``. Close it (or use it as a context manager) to print its last state."""
    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.1 if tty else LOG_INTERVAL_S,
        dynamic_ncols=tty,
    )
