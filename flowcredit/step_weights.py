"""Per-step loss weights: how much each trained step's policy loss counts; docs/algorithms.md,
"Per-step loss weights".

An entry of :data:`STEP_WEIGHTS` is ``fn(sigmas (M + 1,), trained (M,), std (M,) | None, **options) ->
(M,)``: the factor on each trained step's policy loss (0 on untrained steps). Options live with the
entry, resolved and checked as a step schedule's (:mod:`flowcredit.step_schedules`). Entries:
``uniform`` (1), ``tempflow`` (TempFlow-GRPO, arXiv 2508.04324: exploration std over its mean on
trained steps; the code hard-codes the reciprocal mean, 2.25 / 1.73), ``grpo_guard`` (1/Δt, GRPO-Guard,
arXiv 2510.22319's code), ``flash`` (Flash-GRPO, arXiv 2605.15980: the reciprocal of ``∂logp/∂v``'s scale
over its mean on the candidate steps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.step_schedule_flash import flash_candidates
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


def flash_coefficients(sigmas: torch.Tensor) -> torch.Tensor:
    """Flash-GRPO's rectification coefficient of every step ``(N,)`` of ``sigmas (N + 1,)``:
    ``c_i = 1 / (√Δ_i/g_i + g_i·√Δ_i·(1 − σ_i)/(2σ_i))``, ``Δ_i = σ_i − σ_{i+1}``,
    ``g_i = σ_N + (σ_1 − σ_N)·σ_i`` (the SDE's diffusion coefficient, :func:`flowcredit.sde.flash_sde_step`).

    ``1/c_i`` is the scale of ``∂logp/∂v`` at step ``i``: with ``mean = x + Δt·[v + g²/(2σ)(x + (1 − σ)v)]``
    and ``std = g·√Δ``, ``|∂mean/∂v| / std = √Δ/g + g·√Δ·(1 − σ)/(2σ)``. float64 inside.
    """
    sig = sigmas.double()
    delta = (sig[:-1] - sig[1:]).clamp_min(0.0)
    g = sig[-1] + (sig[1] - sig[-1]) * sig[:-1]
    root = delta.sqrt()
    return 1.0 / (root / g + g * root * (1.0 - sig[:-1]) / (2.0 * sig[:-1]))


def flash_weights(sigmas, trained, std=None, *, candidates=0) -> torch.Tensor:
    """Flash-GRPO's temporal gradient rectification: ``w_i = c_i / mean_{j < K} c_j`` on trained steps
    (0 elsewhere), ``c`` from :func:`flash_coefficients`, ``K`` the steps the schedule ``flash`` draws
    from (:func:`flash_candidates`; keep ``candidates`` equal to the schedule's). ``std`` is not read.

    Source (Shredded-Pork/Flash-GRPO at 4211013): ``scripts/train_wanx2_1_flash.py`` L983-997 multiplies
    each row's clipped loss by ``c`` of its step (a table of c at the first 10 of their 20 steps, L984,
    which this formula reproduces to 4 decimals) over the batch mean of c (L990: every rank's rows of
    the micro-batch); ``c`` is ``coe`` of ``…_sample.py`` L87. Deviation: the mean is over the candidate
    steps, not the batch's rows (UniRL's port, ``rectification_indices``): with one group per
    iteration the batch mean would make every weight 1; under the uniform draw the two agree on average.
    """
    n = sigmas.numel() - 1
    k = flash_candidates(n, candidates)
    if n < 2 or not 1 <= k <= n:  # N = 1: g = σ_1 − σ_1·σ vanishes
        raise ValueError(f"flash weights: candidates {candidates} not within the {n} steps (N >= 2)")
    if bool(sigmas[:k].min() <= 0):
        raise ValueError("flash weights: a candidate step starts at σ = 0")
    c = flash_coefficients(sigmas)  # (N,)
    w = c / c[:k].mean()
    return torch.where(trained, w, torch.zeros_like(w)).float()


def _check_flash(o: dict) -> None:
    if o["candidates"] < 0:
        raise ValueError(f"step weight 'flash': option 'candidates' must be >= 0, got {o['candidates']}")


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
register_step_weight("flash", flash_weights, validate=_check_flash)
