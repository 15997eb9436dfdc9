"""Micro-batches of one optimizer step, shared by both kinds of update (the PPO update over trained
steps in :mod:`flowcredit.train`, the forward-process update over time draws in
:mod:`flowcredit.run.forward_update`), and the DDP weight check after an update."""

from __future__ import annotations

import torch


def param_spread(s) -> dict:
    """``dist/param_maxdiff``: with DDP every rank must hold the same weights (FSDP: its shards)."""
    if s.dist.world == 1 or s.dist.sharded:
        return {}
    flat = torch.cat([p.detach().reshape(-1) for p in s.params])[None]
    return {"dist/param_maxdiff": (s.dist.gather_rows(flat) - flat).abs().max().item()}


def micro_batches(
    window: list[int], rows_at: dict, batch_size: int, n_rows: dict, world: int, chunks: int = 0
):
    """``(step, rows, weight, sync)`` of one optimizer step's micro-batches on this rank: each trained
    step ``i`` of ``window`` × chunks of ``batch_size`` of its kept rows ``rows_at[i]``. ``sync`` marks
    the last one (its backward all-reduces the accumulated gradients).

    ``weight = |rows| / n_rows[i] / |window| · world``: ``n_rows[i]`` counts the rows of step ``i`` on
    every rank, so the weights of all ranks' micro-batches sum to 1, and DDP's average over ranks (a
    division by ``world``) turns the ``· world`` back into the sum. A rank without rows still runs one
    zero-weight pass on row 0, so that every rank joins the all-reduce. ``chunks`` (FSDP, where every
    forward pass gathers weights collectively): the row chunks of the busiest rank; zero-weight passes
    pad this rank's micro-batches to ``|window| · chunks``.
    """
    units = [
        (
            i,
            rows_at[i][lo : lo + batch_size],
            len(rows_at[i][lo : lo + batch_size]) / n_rows[i] / len(window) * world,
        )
        for i in window
        for lo in range(0, len(rows_at[i]), batch_size)
    ]
    if not units:
        units = [(window[0], torch.zeros(1, dtype=torch.long), 0.0)]
    units += [(window[-1], torch.zeros(1, dtype=torch.long), 0.0)] * (len(window) * chunks - len(units))
    return [(i, r, weight, k == len(units) - 1) for k, (i, r, weight) in enumerate(units)]
