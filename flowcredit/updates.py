"""Update rules: the loss of one micro-batch, given what the rollout collected (docs/algorithms.md,
"Update rules").

Two kinds, told apart by ``needs`` (:data:`NEEDS`):
- reverse process (``"logp"``): re-score a stored SDE transition ``x_i → x_{i+1}`` under the current
  policy. ``clipped`` (Flow-GRPO's PPO surrogate, :func:`flowcredit.losses.clipped_surrogate`),
  ``ratio_norm`` (GRPO-Guard, arXiv 2510.22319) and ``dppo`` (Flow-DPPO, arXiv 2606.11025: a trust
  region on the transitions' exact divergence instead of the ratio clip).
- forward process (``"clean"``): noise the rollout's final sample afresh and regress the velocity
  there, as in pretraining; no likelihood, any sampler. ``awm`` (Advantage Weighted Matching, arXiv
  2509.25050), ``nft`` (DiffusionNFT, arXiv 2509.16117) and ``dgpo`` (DGPO, arXiv 2510.08425, in
  :mod:`flowcredit.update_dgpo`: a group's preference against the reference, one noise per group).

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

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.update_dgpo import dgpo, dgpo_clipped, dgpo_group_weights, dgpo_times
from flowcredit.update_rules import (
    AWM_WEIGHTINGS,
    NFT_WEIGHTINGS,
    awm,
    awm_times,
    awm_weighted_error,
    clipped,
    dppo,
    dppo_divergence,
    dppo_masked,
    matching_error,
    nft,
    nft_optimality,
    nft_times,
    noised,
    normalized_log_ratio,
    ratio_norm,
    soft_update_decay,
    velocity_kl,
)

# the registry, and the rules it registers (defined in flowcredit.update_rules)
__all__ = [
    "NEEDS",
    "SAMPLES_WITH",
    "UPDATES",
    "Update",
    "UpdateFn",
    "register_update",
    "resolve_options",
    "AWM_WEIGHTINGS",
    "NFT_WEIGHTINGS",
    "awm",
    "awm_times",
    "awm_weighted_error",
    "clipped",
    "dgpo",
    "dgpo_clipped",
    "dgpo_group_weights",
    "dgpo_times",
    "dppo",
    "dppo_divergence",
    "dppo_masked",
    "matching_error",
    "nft",
    "nft_optimality",
    "nft_times",
    "noised",
    "normalized_log_ratio",
    "ratio_norm",
    "soft_update_decay",
    "velocity_kl",
]

NEEDS: dict[str, tuple[str, ...]] = {
    "logp": ("logp_new", "logp_old"),
    "mean": ("mean_new", "mean_old", "std"),
    "clean": ("clean",),
    "noise": ("noise",),
    "time": ("t",),
    "velocity": ("v_theta",),
    "old_velocity": ("v_old",),
    "ref_velocity": ("v_ref",),
    "group": ("group",),
}
"""What the loop can provide, and the keywords it passes for each (besides ``adv (B,)``):
``logp``: the current policy's log-density of the stored transition (with grad) and the rollout's;
``mean``: both transition means ``(B, …)`` and the step's std ``(B,)``; ``clean``: the rollout's
final latent; ``noise``: fresh ``ε ~ N(0, I)``; ``time``: ``t (B,)`` from the rule's ``times``;
``velocity``: the current policy's velocity at ``noised(clean, noise, t)`` (with grad);
``old_velocity``: the old policy's velocity at the same point (no grad; a second forward);
``ref_velocity``: the reference policy's there (no grad; the forward the KL term takes at β > 0);
``group``: ``(B,)`` integer ids of the rows' groups, each micro-batch holding whole groups."""

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
        drops_zero_advantage: True if a row whose advantage is 0 adds no policy-term gradient at any
            θ, so the loop may drop the groups whose advantages are all zero before the update (the
            clipped surrogates: ``A·r`` is 0; their KL term at β > 0 is dropped with them, as
            Flow-GRPO's code does). False (the default, always correct) keeps every row of a group
            with valid rewards: AWM's ``old_beta`` KL and DiffusionNFT's ``r = ½`` branches pull θ
            toward the old policy at advantage 0 once θ ≠ old, and the loss's mean runs over the
            whole batch, as in both authors' codes.
        clipfrac: ``(**keywords of fn, **options) -> fraction`` of the rows the rule clips or masks
            (``stats/clipfrac``); None: the ratio against ``clip_range`` (a rule that needs ``mean``:
            GRPO-Guard's normalised ratio).
        group_noise: forward-process rules: one fresh noise per group and draw, shared by the group's
            rows (DGPO's ``use_shared_noise``), instead of one per row.
    """

    fn: UpdateFn
    needs: tuple[str, ...]
    options: Mapping[str, object] = field(default_factory=dict)
    fields: Mapping[str, str] = field(default_factory=dict)
    times: Callable[..., torch.Tensor] | None = None
    old_decay: Callable[..., float] | None = None
    samples_with: str = "current"
    check: Callable[[Mapping[str, object]], None] | None = None
    drops_zero_advantage: bool = False
    clipfrac: Callable[..., torch.Tensor] | None = None
    group_noise: bool = False

    @property
    def forward(self) -> bool:
        """True for a forward-process rule (trains at fresh noised points, not at rollout states)."""
        return "clean" in self.needs

    @property
    def doc(self) -> str:
        """The first line of the loss function's docstring."""
        return (inspect.getdoc(self.fn) or "").partition("\n")[0]

    def calls(self, beta: float) -> int:
        """Network calls per row and time draw of a forward-process rule: θ, the old policy, and the
        reference when β > 0 or the loss needs it."""
        return 2 + int(bool(beta) or "ref_velocity" in self.needs)

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
    drops_zero_advantage: bool = False,
    clipfrac: Callable[..., torch.Tensor] | None = None,
    group_noise: bool = False,
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
    if not forward and (
        {"old_velocity", "ref_velocity", "group", *_POINT} & set(needs)
        or "mean" in needs
        and "logp" not in needs
    ):
        raise bad("a reverse-process rule takes 'logp' and optionally 'mean'")
    if forward != (times is not None):
        raise bad("a forward-process rule, and only one, must give its time sampler `times`")
    if group_noise and not forward:
        raise bad("group_noise is for a forward-process rule")
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
    entry = Update(fn, needs, options, fields, times, old_decay, samples_with, check, drops_zero_advantage)
    entry = dataclasses.replace(entry, clipfrac=clipfrac, group_noise=group_noise)
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


# --- option checks and the registry ------------------------------------------------------------

_LIMITS: dict[str, tuple[Callable[[float], bool], str]] = {
    "clip_range": (lambda v: v > 0, "> 0"),
    "kl_mask_threshold": (lambda v: v > 0, "> 0"),
    "adv_scale": (lambda v: v > 0, "> 0"),
    "power": (lambda v: v > 0, "> 0"),
    "beta": (lambda v: v > 0, "> 0"),
    "old_beta": (lambda v: v >= 0, ">= 0"),
    "beta_dpo": (lambda v: v > 0, "> 0"),
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

# the clipped surrogates: a row with A = 0 adds no policy-term gradient, so the loop drops all-zero
# groups (with β > 0 their KL term would pull toward the reference; Flow-GRPO's code drops them too)
register_update(
    "clipped",
    clipped,
    ("logp",),
    {"clip_range": 1e-3},
    fields={"clip_range": "clip_range"},
    check=_checker(),
    drops_zero_advantage=True,
)
register_update(
    "ratio_norm",
    ratio_norm,
    ("logp", "mean"),
    {"clip_range": 2e-6},
    check=_checker(),
    drops_zero_advantage=True,
)
register_update(
    "dppo",
    dppo,
    ("logp", "mean"),
    {"kl_mask_threshold": 1e-5, "add_kl_coefficient": True},
    check=_checker(),
    drops_zero_advantage=True,
    clipfrac=lambda **given: dppo_masked(**given).float().mean(),  # the rows outside the trust region
)
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
# DGPO (config/dgpo.py, GenEval): β_dpo 100, the matching loss clipped at 1e-2 against the old policy,
# 4 shared times from steps 0-4 of 10, the old policy's η = min(0.001·step, 0.3) (its ``ema_ref``)
_DGPO = {"beta_dpo": 100.0, "clip_range": 1e-2, "time_draws": 4, "time_fraction": 0.5, "old_decay_max": 0.3}
register_update(
    "dgpo",
    dgpo,
    (*_FORWARD, "ref_velocity", "group"),
    _DGPO | _OLD,
    times=dgpo_times,
    old_decay=soft_update_decay,
    check=_checker(),
    drops_zero_advantage=True,  # A = 0 adds 0 to its group's sum and A·ℓ = 0: no gradient at any θ
    group_noise=True,
)
