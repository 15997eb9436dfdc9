"""CoCA's step contributions (Liao et al., arXiv 2505.19196; docs/algorithms.md §5.5): how much of
the way from the first clean prediction to the sampled image each step covered, measured by the cosine
similarity of clean predictions to the final latent. torch only.

Read in github.com/Lil-Shake/CoCA at d8233a5 (its code files are those of 6c9f585):
``coca/diffusers_patch/pipeline_with_logprob_coca.py`` L240-263 (similarities, window gains, shares)
and ``scripts/train_coca.py`` L482-486 (the share still to come at each step).

Shapes: ``M`` steps of a segment of the trajectory and its ``M + 1`` states; ``c (B, M + 1)`` with
``c_j = cos(x̂0_j, x_N)`` (the last state of the trajectory is the final latent itself, ``c_N = 1``).

Deviations from the code:
1. A window that does not divide ``M`` (the code's ``view`` raises): the last window holds the rest of
   the steps and each of its steps gets ``g_k / (Σg · its length)``, so the shares still sum to 1.
2. ``|Σg| ≤ eps`` (the first prediction as close to the image as the last window; the code divides by
   it unguarded: inf or NaN): that row's steps share equally, ``1/M`` each.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def similarity_to_final(clean: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """``c (B, M)``: cosine similarity of each flattened clean prediction ``clean (B, M, …)`` to the
    flattened final latent ``final (B, …)`` of its row, in float32 (pipeline L242-246)."""
    flat = clean.float().flatten(2)  # (B, M, D)
    target = final.float().flatten(1)[:, None]  # (B, 1, D)
    return F.cosine_similarity(flat, target, dim=-1)


def window_shares(similarity: torch.Tensor, window: int, eps: float) -> torch.Tensor:
    """Each step's share of the similarity gained, ``(B, M + 1) -> (B, M)``, summing to 1 over a row.

    Windows ``k`` of ``window`` consecutive steps; ``m_k`` = the mean of ``c`` over the states *after*
    the window's steps (``c_{kW+1} … c_{kW+W}``); gains ``g_0 = m_0 − c_0``, ``g_k = m_k − m_{k−1}``; each
    step of window k gets ``g_k / (Σ_k g_k · W)`` (pipeline L249-263). ``Σ_k g_k = m_last − c_0``
    telescopes; a row with ``|Σg| ≤ eps`` gets ``1/M`` per step (module docstring, deviation 2).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    c = similarity.float()
    b, m = c.shape[0], c.shape[1] - 1
    of_step = torch.arange(m, device=c.device) // window  # (M,) each step's window
    size = torch.bincount(of_step).to(c)  # (K,) steps per window (the last may be shorter)
    means = torch.zeros(b, size.numel(), device=c.device).index_add_(1, of_step, c[:, 1:]) / size  # (B, K)
    gains = means - torch.cat([c[:, :1], means[:, :-1]], dim=1)  # (B, K)
    total = gains.sum(dim=1, keepdim=True)  # (B, 1) = m_last − c_0
    per_step = (gains / size)[:, of_step]  # (B, M)
    degenerate = total.abs() <= eps
    share = per_step / torch.where(degenerate, torch.ones_like(total), total)
    return torch.where(degenerate, torch.full_like(share, 1.0 / m), share)


def remaining_share(shares: torch.Tensor) -> torch.Tensor:
    """``s_j = Σ_{l ≥ j} w_l``: the share of the gain made from step j to the end, ``(B, M) -> (B, M)``
    (train_coca.py L482-486: a reversed running sum; ``s_0 = 1`` when the shares sum to 1)."""
    return shares.flip(1).cumsum(1).flip(1)
