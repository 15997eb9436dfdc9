"""DenseGRPO's exploration-space calibration (Deng et al. 2025, Algorithm 1).

For each step i, with ``P = #{d_i > 0}`` and ``Q = #{d_i < 0}`` over the sampled trajectories: if
``|P − Q| < ε1`` the reward signs are balanced and the noise can grow (``ψ_i += ε2``), otherwise it
shrinks (``ψ_i −= ε2``), clamped at ``ψ_i ≥ ε2``. ψ_i is the diffusion coefficient ``g`` of step i
(``dance_sde`` with a per-step level). The driver repeats until every trained ψ_i has oscillated
(its update changed direction at least once) or a cap of iterations is reached (our choice; the
paper gives no stopping rule beyond convergence).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def update_psi(
    psi: torch.Tensor, d: torch.Tensor, trained: torch.Tensor, eps1: float = 2, eps2: float = 0.01
) -> torch.Tensor:
    """One step of Algorithm 1 on the trained steps.

    Args:
        psi: ``(N,)`` per-step noise levels. d: ``(B, N)`` step rewards of B sampled trajectories.
        trained: ``(N,)`` bool; untrained entries of ψ are returned unchanged.
    Returns:
        ``(N,)`` the updated ψ, clamped at ``eps2`` on trained steps.
    """
    if d.ndim != 2 or d.shape[1] != psi.shape[0] or trained.shape != psi.shape:
        raise ValueError(
            f"shapes: psi {tuple(psi.shape)}, d {tuple(d.shape)}, trained {tuple(trained.shape)}"
        )
    pos = (d > 0).sum(dim=0)
    neg = (d < 0).sum(dim=0)
    balanced = (pos - neg).abs() < eps1
    step = torch.where(balanced, torch.full_like(psi, eps2), torch.full_like(psi, -eps2))
    new = torch.clamp(psi + step, min=eps2)
    return torch.where(trained, new, psi)


@dataclass
class CalibrationResult:
    """ψ after calibration, whether every trained step oscillated, and the ψ of every iteration."""

    psi: torch.Tensor
    converged: bool
    iterations: int
    history: list[list[float]] = field(default_factory=list)


def calibrate(
    sample_step_rewards: Callable[[torch.Tensor], torch.Tensor],
    psi_init: torch.Tensor,
    trained: torch.Tensor,
    eps1: float = 2,
    eps2: float = 0.01,
    max_iters: int = 100,
    progress: Callable[[int, torch.Tensor], None] | None = None,
) -> CalibrationResult:
    """Run :func:`update_psi` until every trained ψ_i's update has changed direction once.

    Args:
        sample_step_rewards: ``psi (N,) -> d (B, N)``, e.g. rollouts of the frozen policy with
            ``dance_sde`` at per-step level ψ and ``ode_remaining`` values.
        psi_init: ``(N,)`` starting levels (DenseGRPO: Flow-SDE's ``g`` at a = 0.7).
    """
    psi = psi_init.clone().float()
    last_dir = torch.zeros_like(psi)
    flipped = torch.zeros_like(psi, dtype=torch.bool)
    history = [psi.tolist()]
    for it in range(1, max_iters + 1):
        new = update_psi(psi, sample_step_rewards(psi), trained, eps1, eps2)
        direction = torch.sign(new - psi)
        flipped |= (direction * last_dir < 0) | ((direction == 0) & (last_dir < 0))
        last_dir = torch.where(direction != 0, direction, last_dir)
        psi = new
        history.append(psi.tolist())
        if progress is not None:
            progress(it, psi)
        if bool(flipped[trained].all()):
            return CalibrationResult(psi, True, it, history)
    return CalibrationResult(psi, False, max_iters, history)
