"""Flash-GRPO's step schedule ``flash`` (arXiv 2605.15980, ICML 2026): one SDE step per prompt group,
ODE everywhere else (docs/algorithms.md, "Flash-GRPO"). Its loss weight is ``flash`` in
:mod:`flowcredit.step_weights`; its SDE is ``flash_sde`` in :mod:`flowcredit.sde`. This module holds the
draw and imports nothing of the package: the schedule ``flash`` (its plan) is in
:mod:`flowcredit.step_schedules`, which imports it.

Source: Shredded-Pork/Flash-GRPO at 4211013, ``scripts/train_wanx2_1_flash.py`` L693-706 (the draw)
and ``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob_sample.py`` L277-351 (the rollout). Every
iteration, each prompt gets one step ``k`` drawn uniformly from the first 10 of the 20 steps
(``random.choices`` with weights ``[1] * 10``), keyed by the prompt, so that every member of its group
shares it ("iso-temporal grouping": the group's spread does not mix steps of different difficulty).
Each member starts from its own noise, takes Euler ODE steps, one SDE step at ``k``, and the ODE again
to the end; only the transition at ``k`` is stored and trained. No prefix is shared.

Deviations:
1. The draw comes from the plan's generator (seeded by the run's seed and the iteration), one per
   group of the iteration in group order; the code draws with Python's ``random`` on rank 0, keyed by
   the prompt's text, so two groups of one prompt in one batch share a step there, not here.
2. The code passes the step as a one-element list (``index``, L706) that the pipeline compares with
   the loop's integer (L283, L332: never equal; L346: ``index − 1`` raises a TypeError), so the
   script as published stops there. We follow the evident intent (the README's "one-step policy
   optimization", L697's comment, UniRL's port ``unirl/algorithms/flashgrpo.py`` at 7300663).
3. The candidate steps are the first ``⌊N/2⌋`` of our N (theirs: 10 of 20, ``timestep_fraction`` 0.51).
"""

from __future__ import annotations

import torch

__all__ = ["check_flash", "flash_candidates", "flash_group_steps"]


def _fail(option: str, message: str) -> None:
    raise ValueError(f"step schedule 'flash': option {option!r} {message}")


def flash_candidates(n: int, candidates: int) -> int:
    """How many leading steps Flash-GRPO draws from: ``candidates``, or (0) the first half ``⌊N/2⌋``
    (at least one); the step weight ``flash`` normalises over the same steps."""
    return candidates or max(n // 2, 1)


def flash_group_steps(n: int, groups: int, candidates: int, generator: torch.Generator) -> torch.Tensor:
    """``(groups,)`` int64: each group's step, uniform on ``0 … K − 1`` (``K`` from
    :func:`flash_candidates`), drawn in group order from ``generator``."""
    k = flash_candidates(n, candidates)
    if not 1 <= k <= n:
        _fail("candidates", f"gives {k} steps, not within the {n}")
    return torch.randint(0, k, (groups,), generator=generator)


def check_flash(o: dict) -> None:
    """The options' check (``groups`` ≥ 1, ``candidates`` ≥ 0)."""
    for key, low in (("groups", 1), ("candidates", 0)):
        if o[key] < low:
            _fail(key, f"must be >= {low}, got {o[key]}")
