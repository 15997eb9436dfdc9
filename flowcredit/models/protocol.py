"""The model adapter protocol (SPEC §8): what the sampler, the trainer and the evaluator need.

Every model, the built-in tiny one and the diffusers adapters alike, exposes the same five things.
Conventions (SPEC §2): rectified flow ``x_σ = (1 − σ)·x0 + σ·ε``, σ = 1 is noise, the model returns
the velocity ``v ≈ ε − x0``; latents and velocities are float32 whatever the network's dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

Cond = Any
"""Whatever ``encode`` returns; opaque to the sampler, passed back to ``velocity`` unchanged."""


@runtime_checkable
class FlowModel(Protocol):
    """A text-conditioned flow-matching model.

    Attributes:
        latent_shape: ``(C, H, W)`` of one latent.
        guidance_scale: classifier-free guidance weight ``w`` used inside ``velocity``; 1.0 means a
            single conditional pass.
        net: the ``torch.nn.Module`` holding ALL weights (text encoder included), so a trainer can
            wrap LoRA around sub-modules or pick trainable parameters by module name.
    """

    latent_shape: tuple[int, ...]
    guidance_scale: float
    net: torch.nn.Module

    def encode(self, prompts: list[str]) -> Cond:
        """Encode ``B`` prompts (and the null prompt for CFG) under the current grad mode."""
        ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Velocity with CFG: ``v_null + w·(v_cond − v_null)`` (one batched pass of both branches).

        Args:
            x: ``(B, C, H, W)`` float32 latents at noise level ``sigma``.
            sigma: ``(B,)`` float32 noise levels in [0, 1], one per sample.
            cond: ``encode`` output for the same ``B`` rows.
        Returns:
            ``(B, C, H, W)`` float32.
        """
        ...

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, H, W)`` to images ``(B, 3, H', W')`` float32 in [0, 1]."""
        ...

    def trainable_parameters(self) -> Iterable[torch.nn.Parameter]:
        """The parameters with ``requires_grad`` set (what an optimiser should see)."""
        ...
