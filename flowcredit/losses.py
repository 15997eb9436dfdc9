"""The GRPO objective (docs/algorithms.md §6): clipped surrogate, KL to the reference policy, statistics.

``logp`` values are Gaussian log-densities averaged over latent dims (see :mod:`flowcredit.sde`), so
``r = exp(logp_new − logp_old)`` is the per-dimension geometric-mean likelihood ratio, as in Flow-GRPO.
"""

from __future__ import annotations

import torch

KL_MODES = ("exact", "flow_grpo")


def ratio(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """``r = exp(logp_new − logp_old)``."""
    return torch.exp(logp_new - logp_old)


def clipped_surrogate(logp_new, logp_old, adv, clip_range: float) -> torch.Tensor:
    """PPO's clipped objective as a loss: ``mean( max(−A·r, −A·clip(r, 1 − ε, 1 + ε)) )``.

    Args: tensors of one shape (any), ``clip_range`` = ε. Returns a scalar.
    """
    r = ratio(logp_new, logp_old)
    unclipped = -adv * r
    clipped = -adv * torch.clamp(r, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean()


def gaussian_kl(mean: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``KL(N(μ, s²I) ‖ N(μ_ref, s²I))`` averaged over dims: ``mean_d (μ − μ_ref)² / (2 s²)``.

    Args: ``mean``, ``mean_ref`` ``(B, …)``; ``std (B,)`` the transition std (> 0). Returns ``(B,)``.
    """
    sq = (mean.float() - mean_ref.float()) ** 2
    per_row = sq.mean(dim=tuple(range(1, sq.ndim)))
    return per_row / (2.0 * std.float() ** 2)


def kl_to_reference(mean, mean_ref, std, dt, mode: str = "exact") -> torch.Tensor:
    """KL term ``(B,)``. ``mode="exact"``: :func:`gaussian_kl`. ``mode="flow_grpo"``: Flow-GRPO's code,
    which divides by ``2·g²`` with ``g = std/√(−dt)`` (the diffusion coefficient, not the step std)."""
    if mode == "exact":
        return gaussian_kl(mean, mean_ref, std)
    if mode == "flow_grpo":
        g = std.float() / torch.sqrt(-torch.as_tensor(dt, dtype=torch.float32))
        return gaussian_kl(mean, mean_ref, g)
    raise ValueError(f"kl_mode must be one of {KL_MODES}, got {mode!r}")


@torch.no_grad()
def approx_kl(logp_new: torch.Tensor, logp_old: torch.Tensor) -> torch.Tensor:
    """``½·mean((logp_new − logp_old)²)``, the statistic Flow-GRPO logs."""
    return 0.5 * ((logp_new - logp_old) ** 2).mean()


@torch.no_grad()
def clipfrac(logp_new: torch.Tensor, logp_old: torch.Tensor, clip_range: float) -> torch.Tensor:
    """Fraction of entries whose ratio lies outside ``[1 − ε, 1 + ε]``."""
    return ((ratio(logp_new, logp_old) - 1.0).abs() > clip_range).float().mean()
