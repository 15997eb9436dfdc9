"""Noise schedules σ_0 = 1 > σ_1 > … > σ_N = 0 (diffusers order, docs/algorithms.md §0).

Pure functions of explicit numbers; no scheduler objects.
"""

from __future__ import annotations

import math

import torch


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3 time shift ``σ ← s·σ / (1 + (s − 1)·σ)``; fixes 0 and 1 exactly.

    Args:
        sigma: any shape, values in [0, 1].
        shift: ``s > 0`` (SD3.5 uses 3.0; 1.0 is the identity).
    """
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if shift == 1.0:
        return sigma.clone()
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The sampling schedule: ``linspace(1, 0, N + 1)`` followed by the shift of docs/algorithms.md §0.

    Returns:
        float32 tensor ``(N + 1,)`` with ``σ_0 = 1`` and ``σ_N = 0`` exactly, strictly decreasing.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    base = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    out = shift_sigmas(base, shift).to(torch.float32)
    out[0], out[-1] = 1.0, 0.0
    return out


def resolution_shift_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's resolution-dependent ``μ``: linear in the number of latent tokens."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def exponential_shift_sigmas(sigma: torch.Tensor, mu: float) -> torch.Tensor:
    """FLUX's dynamic shift ``σ ← e^μ / (e^μ + (1/σ − 1))``; 0 maps to 0 and 1 to 1."""
    out = torch.zeros_like(sigma)
    pos = sigma > 0
    out[pos] = math.exp(mu) / (math.exp(mu) + (1.0 / sigma[pos] - 1.0))
    return out
