"""Micro-batches of one optimizer step and the optimizer step with its statistics, shared by both
kinds of update (the PPO update over trained steps in :mod:`flowcredit.train`, the forward-process
update over time draws in :mod:`flowcredit.run.forward_update`), and the DDP weight check after an
update."""

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


class UpdateStats:
    """An update's optimizer steps and the running means of its micro-batches' statistics.

    A micro-batch hands its statistics over as 0-dim tensors (:meth:`add`); they are read back once
    per optimizer step, in one ``tolist`` (on a GPU one synchronisation, not one per value and
    micro-batch), and summed in the micro-batches' order, so the means are the same floats as
    reading each value back at once. ``first`` holds the first micro-batch's statistics, taken
    before any optimizer step (the first ratio's deviation from 1)."""

    def __init__(self, keys: tuple[str, ...]):
        self.totals = dict.fromkeys(keys, 0.0)
        self.grad_norm, self.count, self.updates = 0.0, 0, 0
        self.pending: list[dict[str, torch.Tensor]] = []
        self.first: dict[str, float] | None = None

    def add(self, out: dict[str, torch.Tensor]) -> None:
        self.pending.append(out)

    def optimizer_step(self, s) -> None:
        """Clip, step and clear the accumulated gradients, move the EMA, then read back the
        statistics of the micro-batches since the last step."""
        self.grad_norm += s.dist.clip_grad_norm_(s.params, s.cfg.max_grad_norm)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        if s.ema is not None:
            s.ema.update()
        self.updates += 1
        if not self.pending:
            return
        keys = list(self.pending[0])
        rows = torch.stack([torch.stack([out[k].detach() for k in keys]) for out in self.pending]).tolist()
        if self.first is None:
            self.first = dict(zip(keys, rows[0]))
        for row in rows:
            for key, value in zip(keys, row):
                self.totals[key] = self.totals.get(key, 0.0) + value
        self.count += len(rows)
        self.pending = []

    def means(self) -> dict:
        """Each statistic's mean over micro-batches, the mean gradient norm, the optimizer steps."""
        out = {k: v / max(self.count, 1) for k, v in self.totals.items()}
        out["stats/grad_norm"] = self.grad_norm / max(self.updates, 1)
        out["stats/optimizer_steps"] = self.updates
        return out
