"""Per-step loss weights: how much each trained step's policy loss counts; docs/algorithms.md,
"Per-step loss weights".

An entry of :data:`STEP_WEIGHTS` is ``fn(sigmas (M + 1,), trained (M,), std (M,) | None, **options) ->
(M,)``: the factor on each trained step's policy loss (0 on untrained steps). Options live with the
entry, resolved and checked as a step schedule's (:mod:`flowcredit.step_schedules`). Entries:
``uniform`` (1), ``tempflow`` (TempFlow-GRPO, arXiv 2508.04324: exploration std over its mean on
trained steps; the code hard-codes the reciprocal mean, 2.25 / 1.73), ``grpo_guard`` (1/Δt, GRPO-Guard,
arXiv 2510.22319's code).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.step_schedules import entry_options, resolve_options


def uniform_weights(sigmas, trained, std=None) -> torch.Tensor:
    """1 on every trained step, 0 elsewhere (the loss as it is today)."""
    return trained.float()


def tempflow_weights(sigmas, trained, std=None, *, normalize=True) -> torch.Tensor:
    """TempFlow-GRPO's noise-aware weighting: ``w_i = s_i / mean_{j trained} s_j`` with the exploration
    std ``s_i = σ_i·√Δt_i`` (the sampler's per-step ``std (M,)``); ``normalize=False``: ``w_i = s_i``.

    The authors' code multiplies each step's loss by ``c·s_i`` with c = 2.25 (SD3.5, a = 0.7, 9 of 10
    steps trained) or 1.73 (FLUX, a = 0.9): the reciprocal of that mean (2.241, 1.726), rounded.
    """
    if std is None or std.shape != trained.shape:
        got = None if std is None else tuple(std.shape)
        raise ValueError(f"tempflow weights need the per-step std of shape ({trained.numel()},), got {got}")
    scale = std.float().clone()
    if normalize:
        mean = scale[trained].mean()
        if not bool(mean > 0):
            raise ValueError("tempflow weights: the trained steps have std 0 (ODE steps cannot be weighted)")
        scale = scale / mean
    return torch.where(trained, scale, torch.zeros_like(scale))


def grpo_guard_weights(sigmas, trained, std=None, *, normalize=False) -> torch.Tensor:
    """GRPO-Guard's per-step gradient reweighting: ``w_i = 1/Δt_i``, ``Δt_i = σ_i − σ_{i+1}`` (their
    code: ``policy_loss / sqrt_dt.mean()**2``); ``normalize=True`` divides by its mean over trained steps.

    Paired in the paper with RatioNorm, whose ratio ``exp(std_i·(Δlogp + bias))`` has a gradient ∝ Δt_i;
    1/Δt makes the steps' gradients equal in scale.
    """
    w = 1.0 / (sigmas[:-1] - sigmas[1:]).double()
    if normalize:
        w = w / w[trained].mean()
    return torch.where(trained, w, torch.zeros_like(w)).float()


WeightFn = Callable[..., torch.Tensor]
"""``(sigmas (M + 1,), trained (M,), std (M,) | None, **options) -> (M,)``."""


@dataclass(frozen=True)
class StepWeight:
    """A registered per-step loss weight: its function, its options' defaults and their check."""

    fn: WeightFn
    options: Mapping[str, object] = field(default_factory=dict)
    validate: Callable[[dict], None] | None = None


STEP_WEIGHTS: dict[str, StepWeight] = {}
"""Every per-step loss weight by name."""


def register_step_weight(name, fn, options=None, validate=None) -> StepWeight:
    """Register ``fn`` under ``name`` (``options`` as :func:`register_step_schedule`'s)."""
    if name in STEP_WEIGHTS:
        raise ValueError(f"step weight {name!r} is already registered")
    options = entry_options("step weight", name, fn, (), options)
    STEP_WEIGHTS[name] = StepWeight(fn, options, validate)
    return STEP_WEIGHTS[name]


def step_weights(name, sigmas, trained, std=None, options=None) -> torch.Tensor:
    """Weights ``(M,)`` of entry ``name`` (options resolved and checked)."""
    if name not in STEP_WEIGHTS:
        raise ValueError(f"unknown step weight {name!r}; registered: {', '.join(sorted(STEP_WEIGHTS))}")
    entry = STEP_WEIGHTS[name]
    return entry.fn(sigmas, trained, std, **resolve_options("step weight", name, entry, options))


register_step_weight("uniform", uniform_weights)
register_step_weight("tempflow", tempflow_weights)
register_step_weight("grpo_guard", grpo_guard_weights)
