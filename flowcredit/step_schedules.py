"""Which steps explore and train (step schedules); docs/algorithms.md, "Which steps explore and
train: step schedules". The per-step loss weights are in :mod:`flowcredit.step_weights`.

A **step schedule** turns the sampling grid ``sigmas (N + 1,)`` of one iteration into a
:class:`StepPlan`: the grid the rollout follows (the input grid, or a coarser one whose steps merge
runs of input steps), which of its steps are SDE steps (explore) and which are trained. Every entry of
:data:`STEP_SCHEDULES` is a pure function ``fn(sigmas, *, level, iteration, total, generator,
**options) -> StepPlan``: a plan depends on the iteration and the generator only, so a resumed run
draws the plan the uninterrupted one would have. Options live with the entry (defaults, one-line
errors naming the option), not in the config.

Entries and where they deviate from their paper or code:
1. ``window``: today's fixed window ``[start, start + size)`` (``size`` 0: every step from ``start``
   but the last); equal to ``flowcredit.run.rollout.noise_levels``.
2. ``mixgrpo`` (MixGRPO, arXiv 2507.21802): a window of ``size`` SDE steps sliding by ``stride``
   every ``interval`` iterations; rules from the authors' code (the paper text was not readable
   here). Deviations: the code can reach a start equal to its bound, where the window is empty; we
   stop one earlier. ``random`` draws from the run's generator (the code's NumPy draw is unseeded).
   MixGRPO-Flash's second-order post-window solver is not implemented.
3. ``tempflow`` (TempFlow-GRPO, arXiv 2508.04324): branch plans, ODE everywhere but one SDE step per
   branch. ``branches="all"`` is the authors' code (every step but the last is a branch point each
   iteration); ``uniform`` and ``cycle`` (one branch step per iteration) are our cheaper options.
4. ``egrpo`` (E-GRPO, arXiv 2601.00423): consecutive low-entropy steps merged into one SDE step whose
   Gaussian entropy reaches ``threshold``. The entropy measure and threshold value are our reading:
   they reproduce the units of the authors' released run (16 steps, shift 3, a = 0.7: steps 0, 1,
   2–3, 4–6) but not the τ ≈ 2.2 a summary of the paper quotes.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.entropy_merge import flow_sde_std, merge_entropy, merge_units, step_entropy
from flowcredit.granular import check_g2rpo, g2rpo
from flowcredit.step_plan import StepPlan, plan_levels
from flowcredit.step_schedule_flash import check_flash, flash_group_steps
from flowcredit.tree_plans import branchgrpo, check_branchgrpo, check_treegrpo, treegrpo

__all__ = ["STEP_SCHEDULES", "StepPlan", "StepSchedule", "flow_sde_std", "make_plan", "merge_entropy"]
__all__ += ["merge_units", "merged_plan", "plan_levels", "register_step_schedule", "resolve_options"]
__all__ += ["entry_options", "step_entropy", "window", "mixgrpo", "tempflow", "egrpo"]

_SCHEDULE_KEYWORDS = ("level", "iteration", "total", "generator")


def _steps_plan(sigmas: torch.Tensor, sde: torch.Tensor, branch: bool = False) -> StepPlan:
    """A plan on the input grid whose SDE steps are all trained."""
    n = sigmas.numel() - 1
    return StepPlan(sigmas, sde.clone(), sde.clone(), torch.arange(n + 1), branch)


def _fail(kind: str, name: str, option: str, message: str) -> None:
    raise ValueError(f"{kind} {name!r}: option {option!r} {message}")


def _one_of(name: str, option: str, value, allowed: tuple) -> None:
    if value not in allowed:
        _fail("step schedule", name, option, f"must be one of {allowed}, got {value!r}")


# --- 1. window: today's fixed SDE window ---


def window(sigmas, *, level, iteration, total, generator, start=0, size=0) -> StepPlan:
    """The fixed SDE window ``[start, start + size)``; ``size = 0`` means every step from ``start`` but
    the last (``flowcredit.config.trained_window``). Steps outside are ODE steps."""
    n = sigmas.numel() - 1
    size = size or n - 1 - start
    if not 0 <= start < n:
        _fail("step schedule", "window", "start", f"must lie in [0, {n}), got {start}")
    if size < 1 or start + size > n:
        _fail("step schedule", "window", "size", f"gives [{start}, {start + size}), not within the {n} steps")
    sde = torch.zeros(n, dtype=torch.bool)
    sde[start : start + size] = True
    return _steps_plan(sigmas, sde)


# --- 2. MixGRPO: a sliding window ---

MIXGRPO_STRATEGIES = ("progressive", "random", "decay", "exp_decay")


def mixgrpo_interval(
    start, end, strategy, interval, min_interval, max_interval, decay_from, decay_rate
) -> int:
    """Iterations the window stays at ``start`` (the code's ``iters_per_group``).

    ``progressive``: τ. ``decay``: ``max(τ_min, int(τ_max·(1 − s/end) + τ_min·s/end))``, linear from
    τ_max at s = 0 to τ_min at the bound. ``exp_decay``: ``ceil(τ·exp(−k·max(0, s − s_0)))``.
    """
    if strategy == "decay":
        progress = start / end
        return max(min_interval, int(max_interval * (1 - progress) + min_interval * progress))
    if strategy == "exp_decay":
        return max(1, math.ceil(interval * math.exp(-decay_rate * max(0, start - decay_from))))
    return interval


def mixgrpo_start(iteration: int, end: int, stride: int, held, roll_back: bool) -> int:
    """The window's first step at ``iteration``: positions ``0, stride, 2·stride, …`` below ``end``,
    each held ``held(s)`` iterations; past the last one the window restarts at 0 (``roll_back``) or
    stays there."""
    starts = range(0, end, stride)
    durations = [held(s) for s in starts]
    if iteration >= sum(durations) and not roll_back:
        return starts[-1]
    left = iteration % sum(durations)
    for s, h in zip(starts, durations):
        if left < h:
            return s
        left -= h
    raise AssertionError("unreachable")


def mixgrpo(
    sigmas,
    *,
    level,
    iteration,
    total,
    generator,
    strategy="progressive",
    size=4,
    stride=1,
    interval=25,
    roll_back=True,
    skip_last=2,
    min_interval=1,
    max_interval=10,
    decay_from=13,
    decay_rate=0.1,
) -> StepPlan:
    """MixGRPO's sliding window: SDE (and trained) on ``[s, min(s + size, N − skip_last))``, ODE outside.

    ``s`` from :func:`mixgrpo_start` (``random``: uniform in ``[0, N − skip_last − size]``).
    Defaults: the authors' FLUX script (progressive, w = 4, stride 1, τ = 25, roll back; decay
    τ_max 10, τ_min 1; exp-decay from s_0 = 13 at k = 0.1) and their bound ``max_timesteps = N − 2``
    (``skip_last=2``: the last two steps are never SDE).

    Near the bound this follows the authors' code, not the paper's window of ``size`` steps: from start
    ``end − size + 1`` on the window is cut at ``end`` and shrinks one step per position before it rolls
    back (from iteration 500 at the FLUX script's settings; the preset ``mixgrpo`` trains one step at
    iterations 175–199 of each 200-iteration sweep). docs/algorithms.md, "`mixgrpo`".
    """
    n = sigmas.numel() - 1
    end = n - skip_last
    if end < 1:
        _fail("step schedule", "mixgrpo", "skip_last", f"leaves no step of the {n} to train")
    if strategy == "random":  # uniform in [0, end − size], every iteration
        s = int(torch.randint(0, max(end - size, 0) + 1, (1,), generator=generator))
    else:
        taus = (interval, min_interval, max_interval, decay_from, decay_rate)
        s = mixgrpo_start(
            iteration, end, stride, lambda s: mixgrpo_interval(s, end, strategy, *taus), roll_back
        )
    sde = torch.zeros(n, dtype=torch.bool)
    sde[s : min(s + size, end)] = True
    return _steps_plan(sigmas, sde)


def _check_mixgrpo(o: dict) -> None:
    _one_of("mixgrpo", "strategy", o["strategy"], MIXGRPO_STRATEGIES)
    for key in ("size", "stride", "interval", "min_interval", "max_interval"):
        if o[key] < 1:
            _fail("step schedule", "mixgrpo", key, f"must be >= 1, got {o[key]}")
    for key in ("skip_last", "decay_from", "decay_rate"):
        if o[key] < 0:
            _fail("step schedule", "mixgrpo", key, f"must be >= 0, got {o[key]}")


# --- 3. TempFlow-GRPO: branch steps ---

TEMPFLOW_BRANCHES = ("all", "uniform", "cycle")


def tempflow(sigmas, *, level, iteration, total, generator, branches="all", skip_last=1) -> StepPlan:
    """TempFlow-GRPO's trajectory branching: a branch plan whose SDE (and trained) steps are the branch
    points among steps ``0 … N − 1 − skip_last``.

    ``all``: every one of them, each on its own branch (the authors' code: ``timesteps[:-1]``).
    ``uniform``: one ``k`` drawn uniformly from ``generator``. ``cycle``: ``k = iteration mod K``.
    """
    n = sigmas.numel() - 1
    count = n - skip_last
    if count < 1:
        _fail("step schedule", "tempflow", "skip_last", f"leaves no branch step among the {n}")
    sde = torch.zeros(n, dtype=torch.bool)
    if branches == "all":
        sde[:count] = True
    elif branches == "uniform":
        sde[int(torch.randint(0, count, (1,), generator=generator))] = True
    else:
        sde[iteration % count] = True
    return _steps_plan(sigmas, sde, branch=True)


def _check_tempflow(o: dict) -> None:
    _one_of("tempflow", "branches", o["branches"], TEMPFLOW_BRANCHES)
    if o["skip_last"] < 0:
        _fail("step schedule", "tempflow", "skip_last", f"must be >= 0, got {o['skip_last']}")


# --- 4. E-GRPO: merged high-entropy steps (the merging itself: flowcredit.entropy_merge) ---


def merged_plan(sigmas: torch.Tensor, units: list[tuple[int, int]], branch: bool) -> StepPlan:
    """The plan on the grid where each unit ``(k, m)`` is one SDE (trained) step σ_k → σ_{k+m}; every
    other input step is an ODE step of its own."""
    n = sigmas.numel() - 1
    inner = {k + j for k, m in units for j in range(1, m)}
    index = torch.tensor([i for i in range(n + 1) if i not in inner])
    starts = {k for k, _ in units}
    sde = torch.tensor([int(i) in starts for i in index[:-1]], dtype=torch.bool)
    return StepPlan(sigmas[index], sde, sde.clone(), index, branch)


def egrpo(sigmas, *, level, iteration, total, generator, threshold=1.0, horizon=0.5, branch=True) -> StepPlan:
    """E-GRPO: :func:`merge_units` of the grid at the sampler level ``a``, as a merged-grid plan.

    ``branch=True`` (the authors' code): each merged step is explored on its own branch off the ODE
    trajectory; ``False``: all merged SDE steps in one trajectory (the abstract's wording).
    """
    units = merge_units(sigmas, level, threshold, horizon)
    if not units:  # a grid from σ = 1 always has one: its first step (infinite entropy)
        _fail("step schedule", "egrpo", "threshold", f"{threshold} is reached by no step within the horizon")
    return merged_plan(sigmas, units, branch)


def _check_egrpo(o: dict) -> None:
    if not 0 < o["horizon"] <= 1:
        _fail("step schedule", "egrpo", "horizon", f"must lie in (0, 1], got {o['horizon']}")


# --- 5. Flash-GRPO: one step per group (the draw and its sources: flowcredit.step_schedule_flash) ---


def flash(sigmas, *, level, iteration, total, generator, groups=1, candidates=0) -> StepPlan:
    """Flash-GRPO's per-group plan: group ``g`` of the ``groups`` (``prompts_per_iter``) explores and trains
    step ``group_step[g]`` only (:func:`~flowcredit.step_schedule_flash.flash_group_steps`: uniform on
    the first ``candidates``, 0: ``⌊N/2⌋``); ``sde`` = ``trained`` = the steps drawn."""
    n = sigmas.numel() - 1
    group_step = flash_group_steps(n, groups, candidates, generator)  # (P,)
    sde = torch.zeros(n, dtype=torch.bool)
    sde[group_step] = True
    return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1), group_step=group_step)


# --- registries ---

ScheduleFn = Callable[..., StepPlan]
"""``(sigmas (N + 1,), *, level, iteration, total, generator, **options) -> StepPlan``."""


@dataclass(frozen=True)
class StepSchedule:
    """A registered step schedule: its function, its options' defaults, their check, and the config
    fields that give some options (``window``'s ``start``/``size``: ``window_start``/``window_size``)."""

    fn: ScheduleFn
    options: Mapping[str, object] = field(default_factory=dict)
    validate: Callable[[dict], None] | None = None
    fields: Mapping[str, str] = field(default_factory=dict)


STEP_SCHEDULES: dict[str, StepSchedule] = {}
"""Every step schedule by name."""


def entry_options(kind: str, name: str, fn: Callable, shared, options) -> dict:
    """``options``, or (None) the defaults of ``fn``'s own keywords; ``fn`` must take them all."""
    params = inspect.signature(fn).parameters
    if options is None:
        skip = {"sigmas", "trained", "std", *shared}
        options = {k: p.default for k, p in params.items() if k not in skip and p.default is not p.empty}
    for key in (*shared, *options):
        if key not in params:
            raise ValueError(f"{kind} {name!r}: its function takes no keyword {key!r}")
    return dict(options)


def register_step_schedule(name, fn, options=None, validate=None, fields=None) -> StepSchedule:
    """Register ``fn`` under ``name``. ``options`` (None: the defaults of ``fn``'s own keywords) are
    ``{keyword: default}``; a taken name, or an option or shared keyword (level, iteration, total,
    generator) that ``fn`` does not take, is a ``ValueError``."""
    if name in STEP_SCHEDULES:
        raise ValueError(f"step schedule {name!r} is already registered")
    options = entry_options("step schedule", name, fn, _SCHEDULE_KEYWORDS, options)
    fields = dict(fields or {})
    if set(fields) - set(options):
        raise ValueError(f"step schedule {name!r}: fields name options it does not have")
    STEP_SCHEDULES[name] = StepSchedule(fn, options, validate, fields)
    return STEP_SCHEDULES[name]


def resolve_options(kind: str, name: str, entry, given: Mapping | None) -> dict:
    """``entry``'s defaults with ``given`` applied: an unknown option or a value whose type is not the
    default's (an int passes for a float) is a one-line ``ValueError`` naming it; then the entry's check."""
    options = dict(entry.options)
    known = ", ".join(sorted(entry.options)) or "none"
    for key, value in (given or {}).items():
        if key not in entry.options:
            raise ValueError(f"{kind} {name!r} has no option {key!r} (options: {known})")
        default = entry.options[key]
        ok = type(value) is type(default) or (type(default) is float and type(value) is int)
        if default is not None and not ok:
            raise ValueError(
                f"{kind} {name!r}: option {key!r} must be {type(default).__name__}, got {value!r}"
            )
        options[key] = value
    if entry.validate is not None:
        entry.validate(options)
    return options


def make_plan(name, sigmas, *, level, iteration, total, generator, options=None) -> StepPlan:
    """The plan of schedule ``name`` for one iteration (options resolved and checked)."""
    if name not in STEP_SCHEDULES:
        raise ValueError(f"unknown step schedule {name!r}; registered: {', '.join(sorted(STEP_SCHEDULES))}")
    entry = STEP_SCHEDULES[name]
    opts = resolve_options("step schedule", name, entry, options)
    return entry.fn(sigmas, level=level, iteration=iteration, total=total, generator=generator, **opts)


def _check_window(o: dict) -> None:
    for key in ("start", "size"):
        if o[key] < 0:
            _fail("step schedule", "window", key, f"must be >= 0, got {o[key]}")


register_step_schedule(
    "window", window, validate=_check_window, fields={"start": "window_start", "size": "window_size"}
)
register_step_schedule("mixgrpo", mixgrpo, validate=_check_mixgrpo)
register_step_schedule("tempflow", tempflow, validate=_check_tempflow)
register_step_schedule("egrpo", egrpo, validate=_check_egrpo)
register_step_schedule("treegrpo", treegrpo, validate=check_treegrpo)  # flowcredit/tree_plans.py
register_step_schedule("branchgrpo", branchgrpo, validate=check_branchgrpo)  # flowcredit/tree_plans.py
register_step_schedule("flash", flash, validate=check_flash, fields={"groups": "prompts_per_iter"})
register_step_schedule("g2rpo", g2rpo, validate=check_g2rpo, fields={"clip": "adv_clip"})  # granular.py
