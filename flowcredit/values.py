"""State values ``V_i = R(decode(Φ(x_i)))``: deterministic completions of intermediate states
(docs/algorithms.md §3).

``complete`` returns the clean estimate ``Φ(x_start)`` for every row; the caller decodes and scores.
Rows advance in **lock-step**: every model call covers all rows still running, so the cost is
``max(N − start)`` calls for ``ode_remaining`` (not ``Σ (N − start)``) and ``substeps`` for ``euler``.

Estimators:
- ``ode_remaining`` (DenseGRPO's "n = t", TP-GRPO): Euler ODE along the same remaining schedule
  ``σ_start … σ_N``.
- ``euler`` (Stepwise-Flow-GRPO, k = ``substeps``, default 5): k equal Euler sub-steps from
  ``σ_start`` to 0; ``euler`` with k = 1 is the one-step estimate ``x − σ·v``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Velocity = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _bcast(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return value.view(-1, *([1] * (x.ndim - 1)))


def _lockstep(velocity, x: torch.Tensor, grid: torch.Tensor, remaining: torch.Tensor, with_rows: bool):
    """Euler along per-row σ grids; row b takes ``remaining[b]`` steps ``grid[b, j] → grid[b, j + 1]``.

    Args:
        x: ``(B, …)`` float32 start states. grid: ``(B, M + 1)`` per-row σ sequences.
        remaining: ``(B,)`` int64 number of steps for each row (≤ M).
    """
    out = x.clone()
    num_calls = int(remaining.max().item()) if remaining.numel() else 0
    for j in range(num_calls):
        live = torch.nonzero(remaining > j, as_tuple=True)[0]  # rows still running
        sigma, sigma_next = grid[live, j], grid[live, j + 1]
        x_live = out[live]
        v = (velocity(x_live, sigma, live) if with_rows else velocity(x_live, sigma)).float()
        out[live] = x_live + _bcast(sigma_next - sigma, x_live) * v
    return out


def ode_remaining_grid(sigmas: torch.Tensor, start: torch.Tensor, substeps: int):
    """``ode_remaining``: the rest of the schedule ``σ_start … σ_N``; row b takes ``N − start[b]`` steps.

    Returns ``(grid (B, N + 1), remaining (B,))`` (grid entries past a row's end repeat ``σ_N``).
    """
    n = sigmas.numel() - 1
    idx = (start[:, None] + torch.arange(n + 1, device=start.device)[None, :]).clamp(max=n)  # (B, N + 1)
    return sigmas[idx], n - start


def euler_grid(sigmas: torch.Tensor, start: torch.Tensor, substeps: int):
    """``euler(k)``: k = ``substeps`` equal steps from ``σ_start`` to 0 (none for a row at ``σ_N``).

    Returns ``(grid (B, k + 1), remaining (B,))``.
    """
    if substeps < 1:
        raise ValueError(f"substeps must be >= 1, got {substeps}")
    n = sigmas.numel() - 1
    frac = torch.linspace(1.0, 0.0, substeps + 1, device=start.device)
    grid = sigmas[start][:, None] * frac[None, :]  # (B, k + 1)
    return grid, torch.where(start < n, substeps, 0)


@dataclass(frozen=True)
class Estimator:
    """A registered value estimator.

    Attributes:
        grid: ``(sigmas (N + 1,), start (B,), substeps) -> (grid (B, M + 1), remaining (B,))``, the
            per-row σ sequence the completion follows and how many steps each row takes.
        follows_schedule: the completion walks the sampling schedule itself, so a state whose step is
            deterministic has exactly the value of the next state (the trainer copies it).
    """

    grid: Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
    follows_schedule: bool = False


ESTIMATORS: dict[str, Estimator] = {
    "ode_remaining": Estimator(ode_remaining_grid, follows_schedule=True),
    "euler": Estimator(euler_grid),
}
"""Value estimators by name (the ``estimator`` config field)."""


@torch.no_grad()
def complete(
    velocity: Velocity,
    x: torch.Tensor,
    sigmas: torch.Tensor,
    start: torch.Tensor,
    estimator: str = "ode_remaining",
    substeps: int = 5,
    *,
    with_rows: bool = False,
) -> torch.Tensor:
    """Clean estimate ``Φ(x_start)`` of each row, batched in lock-step.

    Args:
        velocity: ``velocity(x (b, …), sigma (b,)) -> v (b, …)``, e.g. the policy with CFG inside.
        x: ``(B, …)`` states; row b is the state with index ``start[b]`` on the schedule.
        sigmas: ``(N + 1,)`` the schedule, ``σ_0 = 1 … σ_N = 0``.
        start: ``(B,)`` int64 state indices in ``[0, N]``; a row with ``start = N`` is returned as is.
        estimator: a key of :data:`ESTIMATORS` (``"ode_remaining"`` or ``"euler"``).
        substeps: k for ``"euler"``.
        with_rows: call ``velocity(x, sigma, rows)`` with ``rows (b,)`` the indices of the live rows
            in the input batch (so a conditional model can pick each row's prompt encoding).
    Returns:
        ``(B, …)`` float32 clean estimates.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {sorted(ESTIMATORS)}, got {estimator!r}")
    n = sigmas.numel() - 1
    start = torch.as_tensor(start, dtype=torch.long, device=x.device)
    if start.shape != (x.shape[0],):
        raise ValueError(f"start must have shape ({x.shape[0]},), got {tuple(start.shape)}")
    if bool(((start < 0) | (start > n)).any()):
        raise ValueError(f"start indices must lie in [0, {n}], got {start.tolist()}")
    sigmas = sigmas.to(device=x.device, dtype=torch.float32)
    grid, remaining = ESTIMATORS[estimator].grid(sigmas, start, substeps)
    return _lockstep(velocity, x.float(), grid, remaining, with_rows)
