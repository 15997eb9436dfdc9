"""One-step samplers for rectified flow, each a pure function (docs/algorithms.md §1).

Convention (docs/algorithms.md §0): ``x_σ = (1 − σ)·x̂0 + σ·ε``, the model returns
``v ≈ ε − x̂0``, a step maps ``x`` at ``σ`` to ``x_next`` at ``σ' = sigma_next < σ`` and
``dt = σ' − σ < 0``. Predictions at a state: ``x̂0 = x − σ·v`` and ``x̂1 = x + (1 − σ)·v`` (the noise estimate).

Every step returns :class:`SdeStep` ``(x_next, mean, std, logp)``: the transition is Gaussian,
``x_next ~ N(mean, std²·I)``. ``logp`` is the exact Gaussian log-density of ``x_next``
**averaged over the non-batch (latent) dimensions** (Flow-GRPO's convention), and 0 where
``std == 0`` (a deterministic step is never trained). ``logp_mode="cps_mse"`` replaces it with
Flow-GRPO's CPS surrogate ``−mean((x_next − mean)²)``, which is *not* a density: it is offered only
for parity with that code and is never the default.

All arithmetic is float32 whatever the model dtype (bf16 overflows in the drift term).
``sigma``, ``sigma_next`` and ``level`` are floats or ``(B,)`` tensors (per-sample values). ``level``
defaults to 0 (every sampler is then the ODE step); the config defaults are ``DEFAULT_LEVELS``.

Deviations from the papers: none in the formulas. Flow-SDE's ``g = a·√(σ/(1 − σ̃))`` uses
``σ̃ = σ'`` when ``σ = 1`` (as Flow-GRPO's code, which uses σ_1 there) to avoid dividing by zero.
The DDIM-like SDE's ``eta`` default (0.7) is our choice; the Stepwise paper does not state it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

LOGP_MODES = ("gaussian", "cps_mse")
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SdeStep:
    """One sampled (or re-scored) transition.

    Attributes:
        x_next: ``(B, …)`` the next state.
        mean: ``(B, …)`` mean of the Gaussian transition.
        std: ``(B,)`` its standard deviation (0 for a deterministic step).
        logp: ``(B,)`` log-density of ``x_next`` averaged over non-batch dims (0 where std == 0).
    """

    x_next: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    logp: torch.Tensor


def _per_sample(value: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A float or ``(B,)`` tensor as a float32 ``(B,)`` tensor on ``x``'s device."""
    out = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if out.ndim == 0:
        out = out.expand(x.shape[0])
    if out.shape != (x.shape[0],):
        raise ValueError(f"per-sample value must be a float or shape ({x.shape[0]},), got {tuple(out.shape)}")
    return out


def _bcast(value: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(B,)`` → ``(B, 1, …, 1)`` to broadcast against ``x``."""
    return value.view(-1, *([1] * (x.ndim - 1)))


def gaussian_logp(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, mode: str = "gaussian"):
    """Log-density of ``x_next`` under ``N(mean, std²·I)`` averaged over non-batch dims.

    ``mean_d[ −(x' − μ)²/(2s²) − log s − ½ log 2π ]``; rows with ``std == 0`` get 0.
    ``mode="cps_mse"`` returns the unnormalised surrogate ``−mean_d (x' − μ)²`` instead.

    Args:
        x_next, mean: ``(B, …)``. std: ``(B,)``.
    Returns:
        ``(B,)`` float32.
    """
    if mode not in LOGP_MODES:
        raise ValueError(f"logp_mode must be one of {LOGP_MODES}, got {mode!r}")
    sq = (x_next.float() - mean.float()) ** 2
    dims = tuple(range(1, sq.ndim))
    live = std > 0
    if mode == "cps_mse":
        logp = -sq.mean(dim=dims)
    else:
        safe = torch.where(live, std, torch.ones_like(std))
        per_dim = -sq / (2.0 * _bcast(safe, sq) ** 2) - _bcast(torch.log(safe), sq) - _HALF_LOG_2PI
        logp = per_dim.mean(dim=dims)
    return torch.where(live, logp, torch.zeros_like(logp))


def _finish(mean, std, x, *, noise, generator, x_next, logp_mode) -> SdeStep:
    """Draw (or take) ``x_next = mean + std·noise`` and score it."""
    if x_next is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        x_next = mean + _bcast(std, x) * noise.float()
    else:
        x_next = x_next.float()
    return SdeStep(x_next, mean, std, gaussian_logp(x_next, mean, std, logp_mode))


def _flow_drift_mean(v, x, sigma, dt, g):
    """Flow-SDE mean ``x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]`` (all broadcast tensors)."""
    return x + dt * (v + g**2 / (2.0 * sigma) * (x + (1.0 - sigma) * v))


def ode_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """Euler step of the probability-flow ODE: ``x_next = x + dt·v``; std 0, logp 0. ``level`` is ignored."""
    v, x = v.float(), x.float()
    sig, sig_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    mean = x + _bcast(sig_next - sig, x) * v
    std = torch.zeros_like(sig)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


def flow_sde_g(sigma: torch.Tensor, sigma_next: torch.Tensor, a: float | torch.Tensor) -> torch.Tensor:
    """Flow-SDE's diffusion coefficient ``g = a·√(σ/(1 − σ̃))``, ``σ̃ = σ'`` where ``σ = 1`` else ``σ``.

    Args:
        sigma, sigma_next: tensors of one shape (``(B,)`` per sample, or ``(N,)`` a schedule's steps).
    Returns:
        ``g``, same shape. DenseGRPO's calibration starts ψ here (a = 0.7).
    """
    sig_tilde = torch.where(sigma >= 1.0, sigma_next, sigma)
    return a * torch.sqrt(sigma / (1.0 - sig_tilde))


def flow_sde_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """Flow-GRPO's SDE (Liu et al. 2025, eq. 9): marginal-preserving reverse SDE, Euler–Maruyama.

    ``g = a·√(σ / (1 − σ̃))`` (``σ̃ = σ'`` when ``σ = 1``), ``std = g·√(−dt)``,
    ``mean = x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]``. ``level`` is ``a`` (0.7 in the paper).
    """
    v, x = v.float(), x.float()
    sig, sig_next, a = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(level, x)
    g = flow_sde_g(sig, sig_next, a)
    dt = sig_next - sig
    mean = _flow_drift_mean(v, x, _bcast(sig, x), _bcast(dt, x), _bcast(g, x))
    std = g * torch.sqrt(-dt)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


def dance_sde_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """DanceGRPO's SDE: Flow-SDE's drift with a constant diffusion coefficient ``g = level``.

    ``std = g·√(−dt)``; DenseGRPO's calibrated ψ is this step with a per-step ``level = ψ_i``.
    """
    v, x = v.float(), x.float()
    sig, sig_next, g = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(level, x)
    dt = sig_next - sig
    mean = _flow_drift_mean(v, x, _bcast(sig, x), _bcast(dt, x), _bcast(g, x))
    std = g * torch.sqrt(-dt)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


def flash_sde_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """Flash-GRPO's SDE (Shredded-Pork/Flash-GRPO at 4211013,
    ``flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob_sample.py`` L44-74): Flow-SDE's drift with
    a diffusion coefficient linear in σ, ``g = σ_min + (σ_max − σ_min)·σ``.

    Here ``σ_min = 0`` (our grids end at σ_N = 0, as theirs) and ``level`` is ``σ_max``, which the code
    takes from the grid (its second σ, ``sigmas[1]``: 0.98 on its 20-step, shift-3 grid); the preset
    ``flash_grpo`` sets it to its grid's σ_1. ``std = g·√(−dt)``; finite at σ = 1 (unlike Flow-SDE).
    """
    v, x = v.float(), x.float()
    sig, sig_next, top = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(level, x)
    g = top * sig
    dt = sig_next - sig
    mean = _flow_drift_mean(v, x, _bcast(sig, x), _bcast(dt, x), _bcast(g, x))
    std = g * torch.sqrt(-dt)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


def _coefficient_mean(v, x, sig, sig_next, s):
    """``(1 − σ')·x̂0 + √(σ'² − s²)·x̂1`` with ``x̂0 = x − σv``, ``x̂1 = x + (1 − σ)v``."""
    sig_b, next_b = _bcast(sig, x), _bcast(sig_next, x)
    x0_hat = x - sig_b * v
    x1_hat = x + (1.0 - sig_b) * v
    keep = torch.sqrt(torch.clamp(sig_next**2 - s**2, min=0.0))
    return (1.0 - next_b) * x0_hat + _bcast(keep, x) * x1_hat


def cps_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """Coefficients-Preserving Sampling (Wang & Yu 2025): ``std = σ'·sin(α·π/2)``.

    ``mean = (1 − σ')·x̂0 + √(σ'² − std²)·x̂1``; keeps the noise coefficient of ``x_next`` at σ'.
    ``level`` is ``α`` (0.7 in TP-GRPO). The last step (σ' = 0) is deterministic.
    """
    v, x = v.float(), x.float()
    sig, sig_next, alpha = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(level, x)
    std = sig_next * torch.sin(alpha * math.pi / 2.0)
    mean = _coefficient_mean(v, x, sig, sig_next, std)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


def ddim_sde_step(
    v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
) -> SdeStep:
    """Stepwise-Flow-GRPO's DDIM-like SDE: ``std = eta·σ'·√(1 − σ)``, mean as :func:`cps_step`.

    ``level`` is ``eta`` (must keep ``std ≤ σ'``, i.e. ``eta·√(1 − σ) ≤ 1``).
    """
    v, x = v.float(), x.float()
    sig, sig_next, eta = _per_sample(sigma, x), _per_sample(sigma_next, x), _per_sample(level, x)
    std = eta * sig_next * torch.sqrt(torch.clamp(1.0 - sig, min=0.0))
    if bool((std > sig_next + 1e-6).any()):
        raise ValueError(f"ddim_sde: eta too large (std > sigma_next); eta={eta.max().item():.3g}")
    mean = _coefficient_mean(v, x, sig, sig_next, std)
    return _finish(mean, std, x, noise=noise, generator=generator, x_next=x_next, logp_mode=logp_mode)


StepFn = Callable[..., SdeStep]


@dataclass(frozen=True)
class Sampler:
    """A registered sampler: its step function and the constraints the config checks.

    Attributes:
        step: the step function ``(v, x, sigma, sigma_next, level=0.0, *, noise, generator, x_next,
            logp_mode) -> SdeStep``.
        default_level: the paper's noise parameter (``DEFAULT_LEVELS``).
        stochastic: False for a sampler that never adds noise (nothing to train).
        first_step_deterministic: std is 0 at σ = 1 (the first step cannot be trained).
        last_step_deterministic: std is 0 at σ' = 0 (the last step cannot be trained).
        max_level: the largest valid ``level`` (None: no bound).
        level_name: what ``level`` means (a, g, α, η), for messages and docs.
    """

    step: StepFn
    default_level: float
    stochastic: bool = True
    first_step_deterministic: bool = False
    last_step_deterministic: bool = False
    max_level: float | None = None
    level_name: str = "level"


def scaled_noise(step_fn: StepFn, scale: float) -> StepFn:
    """``step_fn`` drawing ``x_next = mean + std·(scale·ε)`` and scoring the draw under its own
    ``N(mean, std²)``: a wider exploration at the same policy density. BranchGRPO's split noise
    (Fredreic1849/BranchGRPO@19fbb9f, ``fastvideo/train_branchgrpo_flux.py`` L263-279: ``noise = randn ·
    split_noise_scale``, the log-density with the step's unscaled ``std_dev_t``). A re-scored transition
    (``x_next`` given) is the step's own; ``scale`` 1 is ``step_fn``."""
    if scale == 1.0:
        return step_fn

    def step(
        v, x, sigma, sigma_next, level=0.0, *, noise=None, generator=None, x_next=None, logp_mode="gaussian"
    ):
        if x_next is None:
            if noise is None:
                noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
            noise = noise.float() * scale
        return step_fn(v, x, sigma, sigma_next, level, noise=noise, x_next=x_next, logp_mode=logp_mode)

    return step


SAMPLER_ENTRIES: dict[str, Sampler] = {}
"""Every sampler by name (the ``sampler`` config field), with its constraints."""

SAMPLERS: dict[str, StepFn] = {}
"""``name -> step function`` for every entry of :data:`SAMPLER_ENTRIES` (the public math API)."""

DEFAULT_LEVELS: dict[str, float] = {}
"""``name -> default level`` for every entry of :data:`SAMPLER_ENTRIES`."""


def register_sampler(name: str, sampler: Sampler) -> Sampler:
    """Register ``sampler`` under ``name`` (``--sampler name``); a taken name is an error."""
    if name in SAMPLER_ENTRIES:
        raise ValueError(f"sampler {name!r} is already registered")
    SAMPLER_ENTRIES[name] = sampler
    SAMPLERS[name] = sampler.step
    DEFAULT_LEVELS[name] = sampler.default_level
    return sampler


register_sampler("ode", Sampler(ode_step, 0.0, stochastic=False))
register_sampler("flow_sde", Sampler(flow_sde_step, 0.7, level_name="a"))
register_sampler("dance_sde", Sampler(dance_sde_step, 0.3, level_name="g"))
register_sampler("flash_sde", Sampler(flash_sde_step, 0.9, level_name="sigma_max"))
register_sampler("cps", Sampler(cps_step, 0.7, last_step_deterministic=True, level_name="alpha"))
register_sampler(
    "ddim_sde",
    Sampler(
        ddim_sde_step,
        0.7,
        first_step_deterministic=True,
        last_step_deterministic=True,
        max_level=1.0,
        level_name="eta",
    ),
)
