"""The rollout of a per-group plan (``StepPlan.group_step``; Flash-GRPO's schedule ``flash``): the rows of
group ``g`` take the ODE everywhere but one SDE step ``group_step[g]`` (docs/algorithms.md, "Flash-GRPO").

The sampler takes one level per step for all rows, so the rows are rolled out in runs: each maximal run
of consecutive rows whose groups share a step is one :func:`flowcredit.run.rollout.rollout` with that
step's level alone. Every run starts from the iteration's SDE generator and keeps its own slice of the
noise of all ``total`` rows, so a row's noise depends on the seed and its global index only, as in one
rollout of the whole batch, however the rows are split over processes. Network calls: ``M`` per row.
"""

from __future__ import annotations

import torch

from flowcredit.run.rollout import Rollout, rollout
from flowcredit.run.sampled import Sampled

__all__ = ["group_sample", "row_steps", "step_runs"]

_ROW_FIELDS = ("states", "logp", "std", "velocities", "means", "uncond")


def row_steps(group_step: torch.Tensor, rows: tuple[int, int, int]) -> torch.Tensor:
    """``(hi − lo,)`` int64: the step of each of this rank's rows ``lo … hi − 1`` of ``total``, whose
    ``P = group_step.numel()`` groups hold ``total / P`` consecutive rows each (``draw_batch``'s order)."""
    total, lo, hi = rows
    groups = group_step.numel()
    if total % groups:
        raise ValueError(f"a per-group plan of {groups} groups cannot split {total} rows into equal groups")
    return group_step[torch.arange(lo, hi) // (total // groups)]


def step_runs(steps: torch.Tensor) -> list[tuple[int, int]]:
    """``[(a, e), …]``: the maximal runs ``steps[a:e]`` of one value, in order, covering ``steps (b,)``."""
    cuts = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1]]
    edges = [0, *cuts, len(steps)]
    return list(zip(edges[:-1], edges[1:]))


def group_sample(model, cond, group, x0, plan, levels, step_fn, generator, rows, **opts):
    """Roll out ``x0 (b, …)`` along the per-group ``plan``: run by run (module docstring). Returns a
    :class:`flowcredit.run.sampled.Sampled` whose ``row_trained (b, M)`` marks each row's one step."""
    total, lo, _ = rows
    b, m = len(group), plan.sde.numel()
    steps = row_steps(plan.group_step, rows)  # (b,)
    parts = []
    for a, e in step_runs(steps):
        k = int(steps[a])
        one = torch.zeros(m, dtype=levels.dtype)  # (M,) the SDE at step k only
        one[k] = levels[k]
        gen = torch.Generator().set_state(generator.get_state())  # each run: the noise of every row
        sub = (total, lo + a, lo + e)
        ro = rollout(model, cond, group[a:e], x0[a:e], plan.sigmas, one, step_fn, gen, rows=sub, **opts)
        parts.append(ro)
    row_trained = torch.zeros(b, m, dtype=torch.bool)
    row_trained[torch.arange(b), steps] = True
    return Sampled(_cat_rows(parts), group, group, row_trained, rows, b * m)


def _cat_rows(parts: list[Rollout]) -> Rollout:
    """The runs' rollouts as one over all their rows (a field kept by every run, else None)."""
    joined = {}
    for name in _ROW_FIELDS:
        values = [getattr(p, name) for p in parts]
        joined[name] = None if any(v is None for v in values) else torch.cat(values)
    return Rollout(**joined)
