"""How a run stops before its last iteration: Ctrl-C, twice if need be.

The first Ctrl-C (SIGINT) asks the loop to stop at its next safe point, the end of the iteration in
flight: it is evaluated and checkpointed, ``final/`` and the summary are written, marked stopped early,
and ``--resume`` continues the run exactly. One line on stderr says so at once, since an iteration of a
large model takes minutes. A second Ctrl-C stops at once (``KeyboardInterrupt``): the last complete
checkpoint stays loadable, as a checkpoint is written aside and swapped in by renames
(:func:`flowcredit.run.checkpoint.save_checkpoint`), and ``metrics.jsonl`` lines after it are dropped
on resume. Under torchrun each rank keeps its own request; the loop sums them, so all ranks stop together.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

ACKNOWLEDGED = "flowcredit: stopping after this iteration (a checkpoint is written); Ctrl-C again to stop now"


class StopRequests:
    """The SIGINT handler of a training run, installed by ``with StopRequests(...) as stop:`` (the previous
    handler comes back on exit). ``stop.ctrl_c``: whether a Ctrl-C asked the run to stop. ``announce``:
    print what each Ctrl-C does (rank 0); ``run_dir``: the run to resume after a second one."""

    def __init__(self, run_dir: Path | str, announce: bool = True):
        self.ctrl_c = False
        self.announce = announce
        self.run_dir = run_dir
        self._previous = None

    def _on_sigint(self, signum, frame) -> None:
        if self.ctrl_c:  # the second: stop now, with the last complete checkpoint as it is
            if self.announce:
                self._say(f"flowcredit: stopping now; flowcredit train --resume {self.run_dir} continues")
            raise KeyboardInterrupt
        self.ctrl_c = True
        if self.announce:
            self._say(ACKNOWLEDGED)

    def _say(self, line: str) -> None:
        """``line`` on stderr; on a terminal from a fresh line, off the progress bar's."""
        print(("\n" if sys.stderr.isatty() else "") + line, file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequests:
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)
