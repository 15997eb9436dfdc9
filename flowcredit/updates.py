"""Update rules: the loss of one micro-batch, given what the rollout collected (docs/algorithms.md,
"Update rules").

Two kinds, told apart by ``needs`` (:data:`NEEDS`):
- reverse process (``"logp"``): re-score a stored SDE transition ``x_i → x_{i+1}`` under the current
  policy. ``clipped`` (Flow-GRPO's PPO surrogate, :func:`flowcredit.losses.clipped_surrogate`) and
  ``ratio_norm`` (GRPO-Guard, arXiv 2510.22319).
- forward process (``"clean"``): noise the rollout's final sample afresh and regress the velocity
  there, as in pretraining; no likelihood, any sampler. ``awm`` (Advantage Weighted Matching, arXiv
  2509.25050) and ``nft`` (DiffusionNFT, arXiv 2509.16117).

Conventions (docs/algorithms.md §0): ``clean`` is the rollout's image latent ``x_N`` (the papers'
``x_0``), ``t`` is a σ value and ``x_t = (1 − t)·clean + t·ε``, the target velocity is ``ε − clean``.
All arithmetic is float32; means run over the non-batch (latent) dims, as ``logp`` does (§2).

Deviations from the papers / their code (each function's docstring has its own):
1. AWM's code wraps its loss in a PPO ratio against the same loss detached, which is exactly 1 in its
   released configs (one optimizer step per rollout); we use the loss itself (the same gradient).
2. KL to the *reference* policy is not part of these losses: the loop adds ``cfg.beta ·
   mean(velocity_kl(v_theta, v_ref))`` for forward-process rules (both codes use that form).
3. GRPO-Guard's per-step gradient reweighting (a per-step loss weight) is not in ``ratio_norm``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.losses import clipped_surrogate

NEEDS: dict[str, tuple[str, ...]] = {
    "logp": ("logp_new", "logp_old"),
    "mean": ("mean_new", "mean_old", "std"),
    "clean": ("clean",),
    "noise": ("noise",),
    "time": ("t",),
    "velocity": ("v_theta",),
    "old_velocity": ("v_old",),
}
"""What the loop can provide, and the keywords it passes for each (besides ``adv (B,)``):
``logp``: the current policy's log-density of the stored transition (with grad) and the rollout's;
``mean``: both transition means ``(B, …)`` and the step's std ``(B,)``; ``clean``: the rollout's
final latent; ``noise``: fresh ``ε ~ N(0, I)``; ``time``: ``t (B,)`` from the rule's ``times``;
``velocity``: the current policy's velocity at ``noised(clean, noise, t)`` (with grad);
``old_velocity``: the old policy's velocity at the same point (no grad; a second forward)."""

_POINT = ("clean", "noise", "time", "velocity")  # every forward-process rule evaluates v_θ at x_t
SAMPLES_WITH = ("current", "old")

UpdateFn = Callable[..., torch.Tensor]
"""``(**inputs of its needs, adv (B,), **options) -> scalar loss``."""


@dataclass(frozen=True)
class Update:
    """A registered update rule.

    Attributes:
        fn: the loss; takes ``adv`` and the keywords of its ``needs`` (:data:`NEEDS`).
        needs: names of :data:`NEEDS`, what the loop must collect and compute.
        options: ``{keyword: default}`` of the rule's own knobs, each a keyword of ``fn``, ``times``
            or ``old_decay`` (:meth:`split` routes them); resolved by :func:`resolve_options`.
        fields: ``{option: config field}`` for options set through an existing config field.
        times: forward-process rules: ``(sigmas (N+1,), batch, generator, **options) -> t (K, B)``,
            K time draws per sample; the loop runs one micro-batch per draw, as per trained step.
        old_decay: ``(step, **options) -> η``: after an update with ``step`` optimizer steps so far,
            the old policy becomes ``η·old + (1 − η)·θ``. None: the old policy is the rollout's.
        samples_with: ``"current"`` (the rollout samples with θ) or ``"old"`` (with the old policy).
        check: ``(options) -> None``, raises ``ValueError`` naming a bad option value.
    """

    fn: UpdateFn
    needs: tuple[str, ...]
    options: Mapping[str, object] = field(default_factory=dict)
    fields: Mapping[str, str] = field(default_factory=dict)
    times: Callable[..., torch.Tensor] | None = None
    old_decay: Callable[..., float] | None = None
    samples_with: str = "current"
    check: Callable[[Mapping[str, object]], None] | None = None

    @property
    def forward(self) -> bool:
        """True for a forward-process rule (trains at fresh noised points, not at rollout states)."""
        return "clean" in self.needs

    @property
    def doc(self) -> str:
        """The first line of the loss function's docstring."""
        return (inspect.getdoc(self.fn) or "").partition("\n")[0]

    def inputs(self) -> tuple[str, ...]:
        """The keywords the loop passes to ``fn`` besides ``adv`` and the options."""
        return tuple(k for need in self.needs for k in NEEDS[need])

    def split(self, options: Mapping[str, object]) -> tuple[dict, dict, dict]:
        """``options`` routed to ``(fn, times, old_decay)`` by the keywords each accepts."""
        parts = []
        for f in (self.fn, self.times, self.old_decay):
            params = inspect.signature(f).parameters if f is not None else {}
            parts.append({k: v for k, v in options.items() if k in params})
        return parts[0], parts[1], parts[2]


UPDATES: dict[str, Update] = {}
"""Every update rule by name."""


def register_update(
    name: str,
    fn: UpdateFn,
    needs: tuple[str, ...],
    options: Mapping[str, object] | None = None,
    *,
    fields: Mapping[str, str] | None = None,
    times: Callable[..., torch.Tensor] | None = None,
    old_decay: Callable[..., float] | None = None,
    samples_with: str = "current",
    check: Callable[[Mapping[str, object]], None] | None = None,
) -> Update:
    """Register an update rule under ``name``; returns its entry. Raises ``ValueError`` for a taken
    name, an unknown or inconsistent ``needs``, or a keyword that no function of the entry accepts."""
    bad = lambda msg: ValueError(f"update rule {name!r}: {msg}")  # noqa: E731
    if name in UPDATES:
        raise ValueError(f"update rule {name!r} is already registered")
    needs, options, fields = tuple(needs), dict(options or {}), dict(fields or {})
    unknown = [n for n in needs if n not in NEEDS]
    if unknown or not needs or len(set(needs)) != len(needs):
        raise bad(f"needs must be distinct names of {tuple(NEEDS)}, got {needs}")
    if ("logp" in needs) == ("clean" in needs):
        raise bad("needs must hold exactly one of 'logp' (reverse process) and 'clean' (forward process)")
    forward = "clean" in needs
    if forward and not set(_POINT) <= set(needs):
        raise bad(f"a forward-process rule needs all of {_POINT}")
    if not forward and ({"old_velocity", *_POINT} & set(needs) or "mean" in needs and "logp" not in needs):
        raise bad("a reverse-process rule takes 'logp' and optionally 'mean'")
    if forward != (times is not None):
        raise bad("a forward-process rule, and only one, must give its time sampler `times`")
    if samples_with not in SAMPLES_WITH or (samples_with == "old" and "old_velocity" not in needs):
        raise bad(f"samples_with must be one of {SAMPLES_WITH}; 'old' needs 'old_velocity'")
    params = inspect.signature(fn).parameters
    for key in ("adv", *(k for n in needs for k in NEEDS[n])):
        if key not in params:
            raise bad(f"its function takes no keyword {key!r}")
    accepted = {k for f in (fn, times, old_decay) if f is not None for k in inspect.signature(f).parameters}
    for key in options:
        if key not in accepted:
            raise bad(f"no function of the entry takes the option {key!r}")
    if set(fields) - set(options):
        raise bad(f"fields name options it does not have: {sorted(set(fields) - set(options))}")
    entry = Update(fn, needs, options, fields, times, old_decay, samples_with, check)
    UPDATES[name] = entry
    return entry


def resolve_options(
    name: str, given: Mapping[str, object] | None = None, field_values: Mapping[str, object] | None = None
) -> dict:
    """The options of update rule ``name``: defaults, replaced by ``field_values`` (options that have a
    config field) and by ``given``. Raises a one-line ``ValueError`` naming an unknown option, one that
    must be set through its field, a wrong type (an int is accepted for a float) or a bad value."""
    if name not in UPDATES:
        raise ValueError(f"unknown update rule {name!r} (known: {', '.join(sorted(UPDATES))})")
    entry = UPDATES[name]
    options = dict(entry.options)
    options.update({k: v for k, v in (field_values or {}).items() if k in entry.fields})
    for key, value in (given or {}).items():
        if key not in entry.options:
            known = ", ".join(sorted(entry.options)) or "none"
            raise ValueError(f"update rule {name!r} has no option {key!r} (options: {known})")
        if key in entry.fields:
            raise ValueError(f"set option {key!r} of {name!r} with its own field --{entry.fields[key]}")
        default = entry.options[key]
        ok = isinstance(value, type(default)) or (isinstance(default, float) and type(value) is int)
        if default is not None and (not ok or isinstance(value, bool) != isinstance(default, bool)):
            raise ValueError(f"option {key!r} of {name!r} must be {type(default).__name__}, got {value!r}")
        options[key] = value
    if entry.check is not None:
        try:
            entry.check(options)
        except ValueError as exc:
            raise ValueError(f"update rule {name!r}: {exc}") from None
    return options


def _require(ok: bool, option: str, message: str) -> None:
    if not ok:
        raise ValueError(f"option {option!r} {message}")


def _dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _col(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(B,)`` → ``(B, 1, …, 1)`` to broadcast against ``x``."""
    return t.view(-1, *([1] * (x.ndim - 1)))


# --- reverse process ---------------------------------------------------------------------------


def clipped(logp_new, logp_old, adv, *, clip_range: float) -> torch.Tensor:
    """Flow-GRPO's clipped surrogate ``mean(max(−A·r, −A·clip(r, 1 ± ε)))``, ``r = exp(logp_new − logp_old)``.

    :func:`flowcredit.losses.clipped_surrogate` unchanged (docs/algorithms.md §6). Args: ``(B,)`` each.
    """
    return clipped_surrogate(logp_new, logp_old, adv, clip_range)


def normalized_log_ratio(logp_new, logp_old, mean_new, mean_old, std) -> torch.Tensor:
    """GRPO-Guard's RatioNorm log-ratio (arXiv 2510.22319): ``ℓ = s·(Δlogp + mean_d(μ_θ − μ_old)²/(2s²))``.

    ``Δlogp = logp_new − logp_old``. With ``x' = μ_old + s·ε`` this is ``ℓ = mean_d(ε·(μ_θ − μ_old))``:
    the quadratic term that shifts the raw log-ratio's mean below 0 is removed (``E_ε ℓ = 0``, so
    ``exp ℓ`` centres on 1), and the ``1/s`` that makes its spread differ from step to step is
    multiplied away; one clip range then binds positive-advantage updates at every noise level.

    Args:
        logp_new, logp_old: ``(B,)`` averaged Gaussian log-densities (§2) of the stored ``x_next``.
        mean_new, mean_old: ``(B, …)`` transition means under the current and the sampling policy.
        std: ``(B,)`` the transition std ``s`` (> 0; the same for both policies).
    Returns:
        ``(B,)`` float32.

    Deviation: per-row ``s``; the authors' code (``scripts/train_sd3_GRPO_Guard.py``) takes the batch
    mean of ``g`` and of ``√(−dt)``, the same number when every row is at one step, as in our loop.
    """
    if (
        mean_new.shape != mean_old.shape
        or not logp_new.shape == logp_old.shape == std.shape == mean_new.shape[:1]
    ):
        raise ValueError("ratio_norm: means must be (B, …) of one shape, logp_new, logp_old and std (B,)")
    if not bool((std > 0).all()):
        raise ValueError("ratio_norm: std must be > 0 (a deterministic step cannot be trained)")
    std = std.float()
    shift = ((mean_new.float() - mean_old.float()) ** 2).mean(dim=_dims(mean_new)) / (2.0 * std**2)
    return (logp_new.float() - logp_old.float() + shift) * std


def ratio_norm(logp_new, logp_old, mean_new, mean_old, std, adv, *, clip_range: float = 2e-6) -> torch.Tensor:
    """GRPO-Guard's surrogate: the clipped surrogate of ``r = exp(ℓ)``, ℓ from :func:`normalized_log_ratio`.

    ``clip_range`` 2e-6 is the authors' config (``config/grpo_guard.py``): ℓ is about ``s`` times the
    raw log-ratio, so Flow-GRPO's ranges do not transfer. Returns a scalar.
    """
    ell = normalized_log_ratio(logp_new, logp_old, mean_new, mean_old, std)
    return clipped_surrogate(ell, torch.zeros_like(ell), adv, clip_range)


# --- forward process ---------------------------------------------------------------------------


def noised(clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process ``x_t = (1 − t)·clean + t·noise`` (§0, σ = t): ``t (B,)`` → float32 ``(B, …)``."""
    tt = _col(t.float(), clean)
    return (1.0 - tt) * clean.float() + tt * noise.float()


def matching_error(v: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching error ``mean_d (v − (noise − clean))²``: ``(B, …) -> (B,)`` float32."""
    return ((v.float() - (noise.float() - clean.float())) ** 2).mean(dim=_dims(v))


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """``mean_d (v − v_ref)²``: ``(B, …) -> (B,)``, the velocity-space KL of AWM's and DiffusionNFT's code."""
    return ((v.float() - v_ref.float()) ** 2).mean(dim=_dims(v))


def _check_forward(v_theta, v_old, clean, noise, t, adv) -> None:
    for name, x in (("v_theta", v_theta), ("v_old", v_old), ("noise", noise)):
        if x.shape != clean.shape:
            raise ValueError(f"{name} must have clean's shape {tuple(clean.shape)}, got {tuple(x.shape)}")
    for name, x in (("t", t), ("adv", adv)):
        if x.shape != clean.shape[:1]:
            raise ValueError(f"{name} must be ({clean.shape[0]},), got {tuple(x.shape)}")


AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
_DELTA = 1e-10  # ghuber's offset inside the power (the authors' code)


def awm_weighted_error(err: torch.Tensor, t: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """AWM's per-sample loss ``ℓ`` from the matching error ``err (B,)``: ``uniform`` err, ``t`` t·err,
    ``t2`` t²·err, ``ghuber`` ``t·((err + δ)^p − δ^p)/p`` (δ = 1e-10, p = ``power``)."""
    t = t.float()
    if weighting == "uniform":
        return err
    if weighting == "t":
        return t * err
    if weighting == "t2":
        return t**2 * err
    if weighting == "ghuber":
        return t * ((err + _DELTA) ** power - _DELTA**power) / power
    raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}")


def awm(
    v_theta, v_old, clean, noise, t, adv, *, weighting="ghuber", power=0.25, adv_scale=5.0, old_beta=1.0
) -> torch.Tensor:
    """Advantage Weighted Matching (Xue et al., arXiv 2509.25050): ``mean_b(â_b·ℓ_b) + β_old·mean_b KL_v``.

    ``ℓ_b`` = :func:`awm_weighted_error` of ``mean_d (v_θ(x_t) − (ε − x̂))²`` (the pretraining loss at
    ``x_t = noised(clean, noise, t)``), ``â = clip(A/adv_scale, −1, 1)``, ``KL_v = mean_d (v_θ − v_old)²``
    to the lagged (old) policy. A positive advantage lowers the sample's matching error, a negative
    one raises it.

    Args:
        v_theta: ``(B, …)`` current velocity at ``x_t`` (with grad). v_old: ``(B, …)`` the old policy's
            there (no grad). clean, noise: ``(B, …)``. t: ``(B,)``. adv: ``(B,)``.
    Returns a scalar.

    Read in the authors' ``scripts/train_sd3_awm.py`` (``compute_log_prob_awm``, the training step) and
    ``config/dgx_awm.py`` (defaults: ghuber p = 0.25, ``adv_clip_max`` 5 with ``advantage_max`` 1,
    ``ema_beta`` 1). Deviations: their loss is the PPO surrogate of ``r = exp(ℓ_old − ℓ)`` with
    ``ℓ_old`` = ℓ detached, so ``r ≡ 1`` and the gradient is ours, ``â·∇ℓ``; its value is ``−mean(â)``
    where ours is ``mean(â·ℓ)``. Float32 where they use float64.
    """
    _check_forward(v_theta, v_old, clean, noise, t, adv)
    err = matching_error(v_theta, clean, noise)  # (B,)
    a = (adv.float() / adv_scale).clamp(-1.0, 1.0)
    loss = (a * awm_weighted_error(err, t, weighting, power)).mean()
    if old_beta:
        loss = loss + old_beta * velocity_kl(v_theta, v_old.detach()).mean()
    return loss


def nft_optimality(adv: torch.Tensor, adv_scale: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r = ½ + ½·clip(A/adv_scale, −1, 1)`` in [0, 1], ``(B,)``."""
    return 0.5 + 0.5 * (adv.float() / adv_scale).clamp(-1.0, 1.0)


NFT_WEIGHTINGS = ("adaptive", "uniform")


def _nft_branch(v, target, t, weighting):
    """One branch's ``(B,)`` loss: ``uniform`` ``mean_d (v − target)²``; ``adaptive`` the code's x0-space
    ``mean_d e² / sg(max(mean_d |e|, 1e-5))`` with ``e = x̂0 − x0 = −t·(v − target)``."""
    if weighting not in NFT_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {NFT_WEIGHTINGS}, got {weighting!r}")
    diff = v - target
    if weighting == "uniform":
        return (diff**2).mean(dim=_dims(v))
    e = _col(t.float(), v) * diff
    scale = e.detach().abs().mean(dim=_dims(v)).clamp(min=1e-5)
    return (e**2).mean(dim=_dims(v)) / scale


def nft(
    v_theta, v_old, clean, noise, t, adv, *, beta=1.0, adv_scale=5.0, weighting="adaptive"
) -> torch.Tensor:
    """DiffusionNFT (Zheng et al., arXiv 2509.16117): ``(Z/β)·mean_b[r·L(v⁺) + (1 − r)·L(v⁻)]``.

    ``v⁺ = (1 − β)·v_old + β·v_θ``, ``v⁻ = (1 + β)·v_old − β·v_θ`` (implicit positive and negative
    policies), ``r`` = :func:`nft_optimality`, ``Z = adv_scale``, ``L`` the matching loss of each branch
    against ``ε − x̂`` at ``x_t = noised(clean, noise, t)`` (:func:`_nft_branch`). ``v_old`` is the
    old (sampling) policy, a soft-updated copy of θ. With ``r > ½`` the gradient moves ``v_θ`` toward
    the target, with ``r < ½`` away from it.

    Args: as :func:`awm`. Returns a scalar.

    Read in the authors' ``scripts/train_nft_sd3.py`` (the training step) and ``config/nft.py``
    (β = 1, 0.1 for OCR; ``adv_clip_max`` Z = 5). ``weighting="adaptive"`` (default) is their code's
    self-normalised x0-space loss; ``"uniform"`` the paper's plain ``‖v − (ε − x̂)‖²``. The factor
    ``Z/β`` is the code's (``ori_policy_loss / beta · adv_clip_max``).
    """
    _check_forward(v_theta, v_old, clean, noise, t, adv)
    v_theta, v_old = v_theta.float(), v_old.detach().float()
    target = noise.float() - clean.float()
    r = nft_optimality(adv, adv_scale)
    pos = _nft_branch((1.0 - beta) * v_old + beta * v_theta, target, t, weighting)
    neg = _nft_branch((1.0 + beta) * v_old - beta * v_theta, target, t, weighting)
    return adv_scale / beta * (r * pos + (1.0 - r) * neg).mean()


# --- time draws and the old policy -------------------------------------------------------------


def awm_times(sigmas, batch: int, generator=None, *, time_draws=6, time_fraction=0.9, time_from_first=False):
    """AWM's times ``(K, B)``: K = ``time_draws`` grid values ``σ_j``, one per stratum of the step indices
    ``[j0, M)`` (``M = int(N·time_fraction)``, ``j0 = 0`` if ``time_from_first`` else 1), shared by the
    rows of a draw. The authors' ``time_type`` "discrete_wo_init" (GenEval, OCR) / "discrete" (PickScore).
    """
    n = sigmas.numel() - 1
    start, stop = (0 if time_from_first else 1), int(n * time_fraction)
    if stop <= start:
        raise ValueError(f"time_fraction {time_fraction} leaves no step index in [{start}, {stop})")
    edges = torch.linspace(start, stop, time_draws + 1).long()  # stratum k: [edges[k], edges[k+1])
    u = torch.rand(time_draws, generator=generator)
    idx = edges[:-1] + (u * (edges[1:] - edges[:-1])).long()
    return sigmas.float()[idx].view(-1, 1).expand(time_draws, batch).clone()


def nft_times(sigmas, batch: int, generator=None, *, time_fraction=0.99):
    """DiffusionNFT's times ``(K, B)``: each row takes K = ``int(N·time_fraction)`` distinct grid values of
    ``σ_0 … σ_{N−1}`` in random order (the sampling schedule's, σ_0 = 1 included)."""
    n = sigmas.numel() - 1
    k = int(n * time_fraction)
    if k < 1:
        raise ValueError(f"time_fraction {time_fraction} draws no time from {n} steps")
    idx = torch.rand(batch, n, generator=generator).argsort(dim=1)[:, :k]  # (B, K): a random permutation
    return sigmas.float()[idx].T.contiguous()


def soft_update_decay(step: int, *, old_decay_rate: float, old_decay_max: float, old_decay_flat: int = 0):
    """``η = 0`` before ``old_decay_flat`` optimizer steps, then ``min((step − flat)·rate, max)``; the old
    policy becomes ``η·old + (1 − η)·θ``. DiffusionNFT's ``return_decay``, AWM's ``kl_ema_decay`` "linear"."""
    return 0.0 if step < old_decay_flat else min((step - old_decay_flat) * old_decay_rate, old_decay_max)


# --- option checks and the registry ------------------------------------------------------------

_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "clip_range": (lambda v: v > 0, "> 0"),
    "adv_scale": (lambda v: v > 0, "> 0"),
    "power": (lambda v: v > 0, "> 0"),
    "beta": (lambda v: v > 0, "> 0"),
    "old_beta": (lambda v: v >= 0, ">= 0"),
    "time_draws": (lambda v: v >= 1, ">= 1"),
    "time_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "old_decay_rate": (lambda v: v >= 0, ">= 0"),
    "old_decay_max": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "old_decay_flat": (lambda v: v >= 0, ">= 0"),
}
"""The valid range of every built-in numeric option (shared names mean the same thing)."""


def _checker(**choices: tuple[str, ...]) -> Callable[[Mapping[str, object]], None]:
    """A ``check`` for the built-ins: each option within :data:`_LIMITS`, or one of its ``choices``."""

    def check(options: Mapping[str, object]) -> None:
        for key, value in options.items():
            if key in choices:
                _require(value in choices[key], key, f"must be one of {choices[key]}, got {value!r}")
            elif key in _LIMITS:
                ok, text = _LIMITS[key]
                _require(ok(value), key, f"must be {text}, got {value!r}")

    return check


_FORWARD = ("clean", "noise", "time", "velocity", "old_velocity")
_OLD = {"old_decay_rate": 0.001, "old_decay_flat": 0}  # + old_decay_max: the soft update of the old policy

register_update(
    "clipped", clipped, ("logp",), {"clip_range": 1e-3}, fields={"clip_range": "clip_range"}, check=_checker()
)
register_update("ratio_norm", ratio_norm, ("logp", "mean"), {"clip_range": 2e-6}, check=_checker())
_AWM = {"weighting": "ghuber", "power": 0.25, "adv_scale": 5.0, "old_beta": 1.0, "time_draws": 6}
_AWM.update({"time_fraction": 0.9, "time_from_first": False, "old_decay_max": 0.3, **_OLD})
_NFT = {
    "beta": 1.0,
    "adv_scale": 5.0,
    "weighting": "adaptive",
    "time_fraction": 0.99,
    "old_decay_max": 0.5,
    **_OLD,
}
_AWM_CHECK, _NFT_CHECK = _checker(weighting=AWM_WEIGHTINGS), _checker(weighting=NFT_WEIGHTINGS)
register_update("awm", awm, _FORWARD, _AWM, times=awm_times, old_decay=soft_update_decay, check=_AWM_CHECK)
register_update(
    "nft",
    nft,
    _FORWARD,
    _NFT,
    times=nft_times,
    old_decay=soft_update_decay,
    samples_with="old",
    check=_NFT_CHECK,
)
