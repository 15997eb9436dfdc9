"""How well a credit rule's per-step credit tracks what each step did (the credit audit,
docs/algorithms.md §"The credit audit"; torch only).

The true advantage of transition ``i`` of a trajectory is ``Δ_i = V(x_{i+1}) − V(x_i)`` with
``V(x) = E[R | x]`` under the policy's own sampler (VinePPO, Kazemnejad et al. 2024, for LLM steps).
A rule is accurate to the degree that its credit ``A (B, N)`` orders the transitions as ``Δ`` does
*within the groups its update compares*: per (prompt group, step), the members of one group at one
step. Inputs shared by every function:

- ``credit (B, N)``, ``delta (B, N)``: the rule's credit and ``Δ`` (or two estimates of ``Δ``).
- ``group (B,)`` int64 prompt-group ids; ``trained (N,)`` bool, the steps the update trains.

Outputs are ``(P, K)`` over the ``P`` groups (sorted ids) and the ``K`` trained steps; NaN where a
statistic is undefined (a constant side: Spearman's ρ of a constant is undefined, and a rule whose
credit is constant within a group carries no ordering, so the audit counts it as ρ = 0 there, see
:func:`group_step_spearman`).
"""

from __future__ import annotations

import torch


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks ``0 … G−1`` along the last dim of ``x (..., G)``, ties given their average rank."""
    order = x.argsort(dim=-1, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks.scatter_(-1, order, torch.arange(x.shape[-1], dtype=torch.float64).expand(x.shape).contiguous())
    # ties: the mean rank over equal values (G is a group size: the (G, G) comparison is cheap)
    equal = (x.unsqueeze(-1) == x.unsqueeze(-2)).to(torch.float64)  # (..., G, G)
    return (equal @ ranks.unsqueeze(-1)).squeeze(-1) / equal.sum(-1)


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman's ρ along the last dim of ``a, b (..., G)``: Pearson's r of the average ranks; NaN
    where either side is constant."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(-1, keepdim=True), rb - rb.mean(-1, keepdim=True)
    denom = (ra.square().sum(-1) * rb.square().sum(-1)).sqrt()
    return torch.where(denom > 0, (ra * rb).sum(-1) / denom.clamp_min(1e-300), torch.nan)


def _by_group(x: torch.Tensor, group: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """``x (B, N)`` → ``(P, K, G)``: the trained steps of each group's members (equal group sizes)."""
    ids, counts = group.unique(return_counts=True)
    if bool((counts != counts[0]).any()):
        raise ValueError(f"groups must be of equal size, got sizes {counts.tolist()}")
    rows = torch.stack([torch.nonzero(group == g, as_tuple=True)[0] for g in ids])  # (P, G)
    return x[:, trained][rows].transpose(1, 2)  # (P, K, G)


def _owned(credit, delta, group, trained, owned, stat) -> torch.Tensor:
    """``(P, K)`` of ``stat(a (g,), d (g,))`` over the members of each (group, step) that own the step's
    transition (``owned (B, N)`` bool); NaN where fewer than 2 do."""
    ids, steps = group.unique(), torch.nonzero(trained, as_tuple=True)[0]
    out = torch.full((len(ids), len(steps)), torch.nan, dtype=torch.float64)
    for p, g in enumerate(ids):
        for j, k in enumerate(steps.tolist()):
            rows = (group == g) & owned[:, k]
            if int(rows.sum()) >= 2:
                out[p, j] = stat(credit[rows, k].double()[None, None], delta[rows, k].double()[None, None])
    return out


def group_step_spearman(credit, delta, group, trained, constant_credit_is_zero: bool = True, owned=None):
    """``(P, K)`` Spearman's ρ between ``credit`` and ``delta`` over the members of each (group, step).

    A credit constant within a (group, step) orders nothing: ρ = 0 there with
    ``constant_credit_is_zero`` (a rule gets no credit for silence), NaN otherwise; a constant
    ``delta`` gives NaN (nothing to order). ``owned (B, N)`` bool: only the members that own the step's
    transition count (a tree's: each transition once, on the first leaf below it; groups of any size).
    """
    if owned is not None:
        return _owned(credit, delta, group, trained, owned, lambda a, d: _rho(a, d, constant_credit_is_zero))
    a, d = _by_group(credit.double(), group, trained), _by_group(delta.double(), group, trained)
    return _rho(a, d, constant_credit_is_zero)


def _rho(a: torch.Tensor, d: torch.Tensor, zero: bool) -> torch.Tensor:
    rho = spearman(a, d)
    if zero:
        flat = (a == a[..., :1]).all(-1) & ~(d == d[..., :1]).all(-1)
        rho = torch.where(flat, torch.zeros_like(rho), rho)
    return rho


def group_step_sign_agreement(credit, delta, group, trained, owned=None) -> torch.Tensor:
    """``(P, K)`` fraction of the members whose credit pushes in ``Δ``'s direction
    (``sign(credit) = sign(Δ)``), over the members where both are non-zero; NaN where none is.
    ``owned``: as :func:`group_step_spearman`."""
    if owned is not None:
        return _owned(credit, delta, group, trained, owned, _agreement)
    a, d = _by_group(credit.double(), group, trained), _by_group(delta.double(), group, trained)
    return _agreement(a, d)


def _agreement(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    counted = (a != 0) & (d != 0)
    agree = ((a.sign() == d.sign()) & counted).sum(-1).double()
    n = counted.sum(-1).double()
    return torch.where(n > 0, agree / n.clamp_min(1), torch.nan)


def spearman_brown(r_half: torch.Tensor) -> torch.Tensor:
    """Reliability of an estimate from all ``M`` completions, from the correlation ``r_half`` of its
    two halves: ``2r / (1 + r)`` (Spearman–Brown); NaN where ``r_half ≤ −1``."""
    return torch.where(r_half > -1, 2 * r_half / (1 + r_half).clamp_min(1e-12), torch.nan)


def mc_delta(completions: torch.Tensor) -> torch.Tensor:
    """``Δ (B, N)`` from Monte-Carlo rewards ``completions (B, N + 1, M)``: ``V̂_i`` = the mean of
    state ``i``'s ``M`` completion rewards (a state whose value is exact repeats it ``M`` times)."""
    values = completions.mean(-1)  # (B, N + 1)
    return values[:, 1:] - values[:, :-1]


def split_halves(completions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``Δ`` of the even and of the odd completions (two independent halves of ``M``)."""
    return mc_delta(completions[..., 0::2]), mc_delta(completions[..., 1::2])
