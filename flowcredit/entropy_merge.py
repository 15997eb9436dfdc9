"""E-GRPO's entropy merging (arXiv 2601.00423): which consecutive low-entropy steps become one SDE step.

Pure functions of the sampling grid: the Flow-SDE transition std of a (merged) step, its Gaussian
entropy per latent dimension, and the units ``(k, m)`` a threshold merges. The step schedule ``egrpo``
(:mod:`flowcredit.step_schedules`, which re-exports these names) turns the units into a plan. The
entropy measure and threshold are our reading of the paper: they reproduce the units of the authors'
released run (16 steps, shift 3, a = 0.7: steps 0, 1, 2–3, 4–6).
"""

from __future__ import annotations

import math

import torch

from flowcredit.sde import flow_sde_g

_HALF_LOG_2PI_E = 0.5 * math.log(2.0 * math.pi * math.e)


def flow_sde_std(sigma: torch.Tensor, sigma_next: torch.Tensor, level: float) -> torch.Tensor:
    """Flow-SDE's transition std ``g(σ, σ')·√(σ − σ')`` for one step σ → σ' (merged or not), as
    ``flowcredit.sde.flow_sde_step`` computes it (``σ̃ = σ'`` at σ = 1, so a step from σ = 1 has
    std = a whatever σ')."""
    return flow_sde_g(sigma, sigma_next, level) * torch.sqrt(sigma - sigma_next)


def step_entropy(std: torch.Tensor) -> torch.Tensor:
    """Differential entropy per latent dimension of ``N(μ, std²)``: ``½·log(2πe) + log std``."""
    return _HALF_LOG_2PI_E + torch.log(std)


def merge_entropy(sigma: torch.Tensor, sigma_next: torch.Tensor, level: float) -> torch.Tensor:
    """The entropy E-GRPO merges by, of steps σ → σ' (one shape, ``(K,)`` → ``(K,)``): :func:`step_entropy`
    of :func:`flow_sde_std`, and +∞ from σ = 1, the paper's reading (as issue 53 reports it):
    ``g = a·√(σ/(1 − σ))`` diverges there, so the first step is a unit of its own at any threshold.
    (Its sampled std stays ``a`` however far it is merged, σ̃ = σ': above ``½·log(2πe) + log a``,
    1.0623 at a = 0.7, no merge from σ = 1 would reach the threshold.) Deviation: the authors' code
    takes σ̃ = the input grid's σ_1 for a merged step from σ = 1, so merging raises its std
    (docs/algorithms.md, "`egrpo`")."""
    entropy = step_entropy(flow_sde_std(sigma, sigma_next, level))
    return torch.where(sigma >= 1.0, torch.full_like(entropy, math.inf), entropy)


def merge_units(
    sigmas: torch.Tensor, level: float, threshold: float, horizon: float
) -> list[tuple[int, int]]:
    """E-GRPO's merged SDE steps as ``(k, m)``: input steps ``k … k + m − 1`` become one step σ_k → σ_{k+m}.

    From k = 0: m is the smallest count with ``H(k, m) = merge_entropy(σ_k, σ_{k+m}, a) ≥ threshold``
    (a step already at the threshold stays alone, m = 1; a step from σ = 1 always does); the next unit
    starts at k + m. Units stop at the first one that cannot reach the threshold or ends past
    ``⌊horizon·N⌋``. ``sigmas (N + 1,)``, decreasing.
    """
    n = sigmas.numel() - 1
    s = sigmas.double()
    limit = math.floor(horizon * n + 1e-9)
    units, k = [], 0
    while k < n:
        ends = torch.arange(k + 1, n + 1)
        entropy = merge_entropy(s[k].expand(len(ends)), s[ends], level)
        reach = torch.nonzero(entropy >= threshold, as_tuple=True)[0]
        if reach.numel() == 0 or int(ends[reach[0]]) > limit:
            break
        m = int(reach[0]) + 1
        units.append((k, m))
        k += m
    return units
