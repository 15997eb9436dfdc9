"""DenseGRPO's exploration-space calibration (Deng et al. 2025, Algorithm 1).

For each step i, with ``P = #{d_i > 0}`` and ``Q = #{d_i < 0}`` over the sampled trajectories: if
``|P − Q| < ε1`` the reward signs are balanced and the noise can grow (``ψ_i += ε2``), otherwise it
shrinks (``ψ_i −= ε2``), clamped at ``ψ_i ≥ ε2``. Ties (``d == 0``) count as neither sign.
ψ_i is the diffusion coefficient ``g`` of step i (``dance_sde`` with a per-step level). The driver
repeats until every trained ψ_i has oscillated (its update changed direction at least ``min_flips``
times) or a cap of iterations is reached (our choice; the paper gives no stopping rule beyond
convergence). docs/algorithms.md §7 has the rule, the tie rule and the stopping rule.
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


def sign_counts(d: torch.Tensor, trained: torch.Tensor) -> dict[str, list]:
    """The counts :func:`update_psi` decides on, per step, for the record.

    Args:
        d: ``(B, N)`` step rewards. trained: ``(N,)`` bool.
    Returns:
        ``{"pos": P, "neg": Q, "ties": #{d == 0}, "tie_frac": ties / #finite}``, each a list of N
        numbers; 0 on untrained steps (and ``tie_frac`` 0 where no entry is finite). NaN and ±inf
        entries are not ties; NaN counts for neither sign, as in :func:`update_psi`.
    """
    if d.ndim != 2 or trained.shape != (d.shape[1],):
        raise ValueError(f"shapes: d {tuple(d.shape)}, trained {tuple(trained.shape)}")
    zero = torch.zeros(d.shape[1], dtype=torch.long)
    pos = torch.where(trained, (d > 0).sum(dim=0).cpu(), zero)
    neg = torch.where(trained, (d < 0).sum(dim=0).cpu(), zero)
    ties = torch.where(trained, (d == 0).sum(dim=0).cpu(), zero)
    finite = torch.where(trained, torch.isfinite(d).sum(dim=0).cpu(), zero)
    frac = ties.double() / finite.clamp(min=1).double()
    return {"pos": pos.tolist(), "neg": neg.tolist(), "ties": ties.tolist(), "tie_frac": frac.tolist()}


@dataclass
class CalibrationResult:
    """ψ after calibration, whether every trained step oscillated, and the record of every round.

    ``history[k]`` is ψ after round k (``history[0]`` the start). ``counts[k]`` is
    :func:`sign_counts` of round k + 1's step rewards, sampled at ``history[k]``. ``flips[i]`` is how
    often step i's update changed direction (0 on untrained steps).
    """

    psi: torch.Tensor
    converged: bool
    iterations: int
    history: list[list[float]] = field(default_factory=list)
    counts: list[dict[str, list]] = field(default_factory=list)
    flips: list[int] = field(default_factory=list)


def calibrate(
    sample_step_rewards: Callable[[torch.Tensor], torch.Tensor],
    psi_init: torch.Tensor,
    trained: torch.Tensor,
    eps1: float = 2,
    eps2: float = 0.01,
    max_iters: int = 100,
    progress: Callable[[int, torch.Tensor], None] | None = None,
    min_flips: int = 1,
) -> CalibrationResult:
    """Run :func:`update_psi` until every trained ψ_i's update has changed direction ``min_flips`` times.

    Args:
        sample_step_rewards: ``psi (N,) -> d (B, N)``, e.g. rollouts of the frozen policy with
            ``dance_sde`` at per-step level ψ and ``ode_remaining`` values.
        psi_init: ``(N,)`` starting levels (DenseGRPO: Flow-SDE's ``g`` at a = 0.7).
        progress: called ``progress(round, psi)`` after each round.
        min_flips: changes of direction each trained ψ_i needs before the loop stops (a round clamped
            at the floor ``eps2`` after a decrease counts as one); 1 is the loosest rule.
    """
    if min_flips < 1:
        raise ValueError(f"min_flips must be >= 1, got {min_flips}")
    psi = psi_init.clone().float()
    last_dir = torch.zeros_like(psi)
    flips = torch.zeros(psi.shape, dtype=torch.long)
    history = [psi.tolist()]
    counts = []
    for it in range(1, max_iters + 1):
        d = sample_step_rewards(psi)
        counts.append(sign_counts(d, trained))
        new = update_psi(psi, d, trained, eps1, eps2)
        direction = torch.sign(new - psi)
        flip = (direction * last_dir < 0) | ((direction == 0) & (last_dir < 0))
        flips += (flip & trained).long().cpu()
        last_dir = torch.where(direction != 0, direction, last_dir)
        psi = new
        history.append(psi.tolist())
        if progress is not None:
            progress(it, psi)
        if bool((flips[trained.cpu()] >= min_flips).all()):
            return CalibrationResult(psi, True, it, history, counts, flips.tolist())
    return CalibrationResult(psi, False, max_iters, history, counts, flips.tolist())
