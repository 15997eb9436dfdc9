"""A mutant of ``benchmarks/mutants/mutants.py``, and the files and tests that more than one area names."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # loop, values, psi, kl, ema, resume, export, credit
    path: str  # file under the repository root
    old: str  # exact text, present once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that should fail
    bug: str  # the bug in words


RESUME_TP = "tests/test_resume.py::test_killed_in_a_checkpoint_write_resumes_exactly"
TRAIN = "flowcredit/train.py"
ROLLOUT = "flowcredit/run/rollout.py"
SESSION = "flowcredit/run/session.py"
