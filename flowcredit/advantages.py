"""Credit assignment: advantages ``(B, N)`` from state values, never from models
(docs/algorithms.md §4–5).

Inputs shared by every method:
- ``values (B, N + 1)``: ``V_0 … V_N`` (``V_i`` = reward of the completion of state i, ``V_N`` = the
  sampled image's reward). Entries a method does not need may be NaN.
- ``group (B,)`` int64 prompt-group ids (never prompt strings).
- ``trained (N,)`` bool: which steps are trained; every other step gets advantage 0.

Step reward ``d_i = V_{i+1} − V_i``. Group statistics: ``(x − mean)/(std + eps)`` with the population
std (ddof = 0); a group whose entries are all equal gives exactly 0. Advantages are clipped to
``±adv_clip``.

Methods (``CREDITS``; ``ADVANTAGES[name]`` is the bare function of each entry):
1. ``flow_grpo`` (Liu et al. 2025): the z-scored terminal reward on every trained step;
   ``global_std=True`` takes the std over the whole batch (their default) with the group mean.
2. ``dense`` (DenseGRPO, Deng et al. 2025): ``d_i`` z-scored per (group, step).
3. ``stepwise`` (Stepwise-Flow-GRPO): ``d_i`` z-scored jointly over all (member, trained step) pairs of
   the group.
4. ``turning_point`` (TP-GRPO): ``d_i``, replaced at turning points by ``V_N − V_i``, balanced, then
   z-scored per (group, step). See :func:`turning_points`.
5. ``coca`` (CoCA): ``flow_grpo``'s advantage scaled at each step by the share of the similarity gain
   still to come (:mod:`flowcredit.contribution`), then z-scored again. Its ``values`` are not rewards
   of states: ``needs="similarity"`` (:data:`NEEDS`).

Deviation (our choice, TP-GRPO is silent): in balancing, a turning point whose aggregated reward is
exactly 0 belongs to neither sign and returns to ``d_i``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flowcredit.contribution import remaining_share, window_shares


def _check(values: torch.Tensor, group: torch.Tensor, trained: torch.Tensor) -> None:
    if values.ndim != 2:
        raise ValueError(f"values must be (B, N + 1), got shape {tuple(values.shape)}")
    b, n1 = values.shape
    if group.shape != (b,):
        raise ValueError(f"group must be ({b},), got {tuple(group.shape)}")
    if trained.shape != (n1 - 1,) or trained.dtype != torch.bool:
        raise ValueError(
            f"trained must be a bool tensor of shape ({n1 - 1},), got {trained.dtype} {tuple(trained.shape)}"
        )


def step_rewards(values: torch.Tensor) -> torch.Tensor:
    """``d_i = V_{i+1} − V_i``: ``(B, N + 1) -> (B, N)``."""
    return values[:, 1:] - values[:, :-1]


def group_zscore(
    x: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float, per_column: bool = True
) -> torch.Tensor:
    """Z-score of the entries of ``x (B, N)`` selected by ``mask (B, N)`` within each group.

    ``per_column=True`` normalises each (group, column) separately; ``False`` pools all masked
    entries of a group. Population std; groups whose selected entries are all equal give 0.
    Unselected entries are 0 in the output.
    """
    out = torch.zeros_like(x, dtype=torch.float32)
    x = torch.where(mask, x.float(), torch.zeros_like(x, dtype=torch.float32))
    for g in torch.unique(group):
        rows = group == g
        xs, ms = x[rows], mask[rows]  # (G, N)
        dims = (0,) if per_column else (0, 1)
        count = ms.sum(dim=dims, keepdim=True).clamp(min=1)
        mean = xs.sum(dim=dims, keepdim=True) / count
        centred = torch.where(ms, xs - mean, torch.zeros_like(xs))
        std = torch.sqrt((centred**2).sum(dim=dims, keepdim=True) / count)
        big = torch.where(ms, xs, torch.full_like(xs, -float("inf"))).amax(dim=dims, keepdim=True)
        small = torch.where(ms, xs, torch.full_like(xs, float("inf"))).amin(dim=dims, keepdim=True)
        z = torch.where(big > small, centred / (std + eps), torch.zeros_like(centred))
        out[rows] = torch.where(ms, z, torch.zeros_like(z))
    return out


def _broadcast_trained(trained: torch.Tensor, b: int) -> torch.Tensor:
    return trained.view(1, -1).expand(b, -1)


def flow_grpo(values, group, trained, *, eps=1e-4, adv_clip=5.0, global_std=False):
    """Flow-GRPO: ``A_b = (V_N − mean_g)/(std + eps)`` copied to every trained step.

    ``global_std=True``: ``std`` over the whole batch instead of the group (group mean kept).
    """
    _check(values, group, trained)
    adv = terminal_zscore(values[:, -1:], group, eps, global_std)
    adv = adv.clamp(-adv_clip, adv_clip) * _broadcast_trained(trained, values.shape[0])
    return adv.float()


def terminal_zscore(final: torch.Tensor, group: torch.Tensor, eps: float, global_std: bool) -> torch.Tensor:
    """``(V_N − mean_g)/(std + eps)`` of ``final (B, 1)``: the group std, or with ``global_std`` the std of
    the whole batch (group mean kept); a group whose rewards are all equal gives 0. Returns ``(B, 1)``."""
    final = final.float()
    if not global_std:
        return group_zscore(final, group, torch.ones_like(final, dtype=torch.bool), eps)
    adv = torch.zeros_like(final)
    std = final.std(unbiased=False)
    for g in torch.unique(group):
        rows = group == g
        if final[rows].max() > final[rows].min():
            adv[rows] = (final[rows] - final[rows].mean()) / (std + eps)
    return adv


def dense(values, group, trained, *, eps=1e-4, adv_clip=5.0):
    """DenseGRPO: ``A_{b,i}`` = z-score of ``d_{b,i}`` over the group at the same step i."""
    _check(values, group, trained)
    mask = _broadcast_trained(trained, values.shape[0])
    return group_zscore(step_rewards(values), group, mask, eps).clamp(-adv_clip, adv_clip)


def stepwise(values, group, trained, *, eps=1e-4, adv_clip=5.0, center=True):
    """Stepwise-Flow-GRPO: ``(d_{b,i} − m)/(s + eps)``, m and s over all (member, trained step) pairs.

    ``center=False`` keeps each gain's sign: ``d_{b,i}/(rms + eps)`` with the root mean square of the
    group's gains (0 for a group whose gains are all 0). A step that raised the reward is then always
    reinforced and one that did nothing gets 0, as the paper describes its gains; centring instead
    moves every zero gain to ``−m/s`` (one gain among 60 sends the 59 zeros to ≈ −0.13).
    """
    _check(values, group, trained)
    mask = _broadcast_trained(trained, values.shape[0])
    d = step_rewards(values)
    if center:
        adv = group_zscore(d, group, mask, eps, per_column=False)
    else:
        adv = group_rms_scale(d, group, mask, eps)
    return adv.clamp(-adv_clip, adv_clip)


def group_rms_scale(x: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / (rms + eps)`` with the root mean square over each group's selected entries of ``x (B, N)``;
    unselected entries and all-zero groups give 0."""
    out = torch.zeros_like(x, dtype=torch.float32)
    x = torch.where(mask, x.float(), torch.zeros_like(x, dtype=torch.float32))
    for g in torch.unique(group):
        rows = group == g
        xs, ms = x[rows], mask[rows]  # (G, N)
        rms = torch.sqrt((xs**2).sum() / ms.sum().clamp(min=1))
        out[rows] = torch.where(ms & (rms > 0), xs / (rms + eps), torch.zeros_like(xs))
    return out


def _window(trained: torch.Tensor) -> tuple[int, int]:
    """First trained step w and window length K; the trained steps must be contiguous."""
    idx = torch.nonzero(trained, as_tuple=True)[0]
    if idx.numel() == 0:
        raise ValueError("turning_point and coca's span='window' need at least one trained step")
    w, k = int(idx[0]), int(idx.numel())
    if int(idx[-1]) != w + k - 1:
        raise ValueError(f"the trained steps must be contiguous here, got steps {idx.tolist()}")
    return w, k


def turning_points(values, trained, constrained=True, first_step=True) -> torch.Tensor:
    """TP-GRPO turning points ``(B, N)`` bool, before balancing.

    With ``Δ = V_N − V_w`` and ``s_i = sign(d_i)·sign(Δ)`` over the window ``[w, w + K)``:
    step ``i > w`` is a turning point iff ``s_{i−1} < 0`` and ``s_i > 0`` (and, if ``constrained``,
    ``sign(d_i) = sign(V_N − V_{i+1}) ≠ 0``). With ``first_step``, step ``w`` is one iff
    ``sign(d_w) = sign(V_N − V_{w+1}) ≠ 0`` (constrained) or ``s_w > 0`` (unconstrained).
    """
    w, k = _window(trained)
    v = values.float()
    d = step_rewards(v)  # (B, N)
    final = v[:, -1:]
    trend = torch.sign(final[:, 0] - v[:, w])  # (B,)
    s = torch.sign(d) * trend[:, None]
    consistent = (torch.sign(d) == torch.sign(final - v[:, 1:])) & (d != 0)  # (B, N)
    tp = torch.zeros_like(d, dtype=torch.bool)
    for i in range(w + 1, w + k):
        tp[:, i] = (s[:, i - 1] < 0) & (s[:, i] > 0)
        if constrained:
            tp[:, i] &= consistent[:, i]
    if first_step:
        tp[:, w] = consistent[:, w] if constrained else s[:, w] > 0
    return tp


def balance_turning_points(tp: torch.Tensor, agg: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Balancing: per group, if both signs of ``agg`` occur among its turning points, keep the
    ``min(#pos, #neg)`` largest-``|agg|`` of each sign; otherwise keep all. Zero ``agg`` is dropped."""
    keep = tp & (agg != 0)
    for g in torch.unique(group):
        rows = torch.nonzero(group == g, as_tuple=True)[0]
        sub_tp, sub_agg = keep[rows], agg[rows]
        pos, neg = sub_tp & (sub_agg > 0), sub_tp & (sub_agg < 0)
        n = min(int(pos.sum()), int(neg.sum()))
        if n == 0:
            continue
        kept = torch.zeros_like(sub_tp)
        for sign_mask in (pos, neg):
            flat = torch.where(sign_mask, sub_agg.abs(), torch.full_like(sub_agg, -1.0)).flatten()
            top = torch.topk(flat, n).indices
            kept.view(-1)[top] = True
        keep[rows] = kept
    return keep


def turning_point(
    values,
    group,
    trained,
    *,
    eps=1e-4,
    adv_clip=5.0,
    constrained=True,
    first_step=True,
    balance="group",
):
    """TP-GRPO: ``d_i`` replaced by ``agg_i = V_N − V_i`` at (balanced) turning points, then
    z-scored per (group, step). ``balance``: ``"group"`` (default) or ``"none"``."""
    _check(values, group, trained)
    if balance not in ("group", "none"):
        raise ValueError(f"balance must be 'group' or 'none', got {balance!r}")
    v = values.float()
    d = step_rewards(v)
    agg = v[:, -1:] - v[:, :-1]  # (B, N): V_N − V_i
    tp = turning_points(v, trained, constrained=constrained, first_step=first_step)
    if balance == "group":
        tp = balance_turning_points(tp, agg, group)
    rewards = torch.where(tp, agg, d)
    mask = _broadcast_trained(trained, v.shape[0])
    return group_zscore(rewards, group, mask, eps).clamp(-adv_clip, adv_clip)


def coca(
    values,
    group,
    trained,
    *,
    eps=1e-4,
    adv_clip=5.0,
    window=1,
    alpha=0.0,
    span="trajectory",
    renorm="group",
    global_std=False,
):
    """CoCA (arXiv 2505.19196): ``A_{b,i} = z(Â_b·(α + (1 − α)·s_{b,i}))`` on the trained steps.

    ``Â_b`` = :func:`flow_grpo`'s clipped terminal advantage; ``s_{b,i} = Σ_{l ≥ i} w_{b,l}``, the share
    of the cosine-similarity gain made from step i on (:func:`flowcredit.contribution.window_shares`,
    ``window`` steps per window; ``s_0 = 1``); ``z`` a second z-score over all (member, trained step)
    entries of each group (``renorm="group"``), of the whole batch (``"batch"``) or none (``"none"``);
    then clipped to ``±adv_clip``. Sources (Lil-Shake/CoCA at d8233a5): ``scripts/train_coca.py``
    L463-478 (``Â``), L482-490 (``s``, α = ``temporal_alpha``), L495-502 (``z``), L621-625 (the clip).

    Deviations (docs/algorithms.md §5.5): both z-scores per prompt group of this iteration (the code's
    tracker: a buffer over epochs, the whole batch until a prompt has 16 rewards: ``renorm="batch"``);
    only trained steps enter the second one; a ragged last window and ``|Σg| ≤ eps`` (equal shares),
    where the code raises or divides by 0.

    Args:
        values: ``(B, N + 1)``: ``c_0 … c_{N−1}`` (``needs="similarity"``) and ``V_N``; ``c_N = 1``.
        span: ``"trajectory"`` (the code: shares over all N steps, untrained ones included) or
            ``"window"`` (over the contiguous trained steps only, from ``c_w`` to ``c_{w+K}``).
        global_std: ``Â`` with the batch std (:func:`flow_grpo`'s option; the config field).
    Returns:
        ``(B, N)`` float32, 0 on untrained steps.
    """
    _check(values, group, trained)
    if span not in ("trajectory", "window") or renorm not in ("group", "batch", "none"):
        raise ValueError(
            f"span: 'trajectory' or 'window'; renorm: 'group', 'batch' or 'none'; got {span!r}, {renorm!r}"
        )
    b, n = values.shape[0], values.shape[1] - 1
    adv = terminal_zscore(values[:, -1:], group, eps, global_std).clamp(-adv_clip, adv_clip)  # (B, 1)
    similarity = torch.cat([values[:, :-1].float(), values.new_ones(b, 1)], dim=1)  # (B, N + 1), c_N = 1
    lo, hi = (0, n) if span == "trajectory" else _span(trained)
    share = values.new_zeros(b, n)
    share[:, lo:hi] = remaining_share(window_shares(similarity[:, lo : hi + 1], window, eps))
    shaped = adv * (alpha + (1 - alpha) * share)  # (B, N): the code's temporal rewards
    mask = _broadcast_trained(trained, b)
    if renorm == "none":
        return torch.where(mask, shaped, torch.zeros_like(shaped)).clamp(-adv_clip, adv_clip)
    pools = group if renorm == "group" else torch.zeros_like(group)
    return group_zscore(shaped, pools, mask, eps, per_column=False).clamp(-adv_clip, adv_clip)


def _span(trained: torch.Tensor) -> tuple[int, int]:
    """``(w, w + K)``: the contiguous trained steps (``span="window"``)."""
    w, k = _window(trained)
    return w, w + k


AdvantageFn = Callable[..., torch.Tensor]
"""``(values (B, N + 1), group (B,), trained (N,), *, eps, adv_clip, **options) -> (B, N)``."""

NEEDS = ("final", "states", "similarity")
"""What a credit method reads: ``"final"`` = only ``V_N`` (the sampled image's reward);
``"states"`` = also ``V_i`` at both ends of every trained step (completions of intermediate states);
``"similarity"`` = ``V_N`` and, in place of ``V_0 … V_{N−1}``, ``c_i = cos(x̂0_i, x_N)`` with the
rollout's one-step clean prediction ``x̂0_i = x_i − σ_i·v_i`` (CoCA; no completion, no reward call)."""


@dataclass(frozen=True)
class Credit:
    """A registered credit method: the function, what it needs, and its own options.

    Attributes:
        fn: the advantage function; it takes ``eps`` and ``adv_clip`` (shared by every method) and
            exactly the keywords named in ``options``.
        needs: ``"final"``, ``"states"`` or ``"similarity"`` (see :data:`NEEDS`).
        options: ``{keyword: default}`` of the method's own options; the config gives them as
            ``credit_options`` (JSON), and an unknown key there is an error naming it.
        fields: ``{keyword: config field}`` for options that also have a config field of their own
            (the built-in methods' ``global_std`` and ``tp_*``); external methods leave it empty.
    """

    fn: AdvantageFn
    needs: str
    options: Mapping[str, object] = field(default_factory=dict)
    fields: Mapping[str, str] = field(default_factory=dict)


CREDITS: dict[str, Credit] = {}
"""Every credit method by name (the ``credit`` config field)."""

ADVANTAGES: dict[str, AdvantageFn] = {}
"""``name -> fn`` for every entry of :data:`CREDITS` (the public math API keeps this dict)."""


def register_credit(
    name: str,
    fn: AdvantageFn,
    needs: str,
    options: Mapping[str, object] | None = None,
    fields: Mapping[str, str] | None = None,
) -> Credit:
    """Register a credit method under ``name`` (``--credit name``); returns its entry.

    ``fn(values, group, trained, *, eps, adv_clip, **options)`` must accept every option as a
    keyword. Raises ``ValueError`` for a taken name, an unknown ``needs`` or an option that ``fn``
    does not accept.
    """
    if name in CREDITS:
        raise ValueError(f"credit method {name!r} is already registered")
    if needs not in NEEDS:
        raise ValueError(f"credit method {name!r}: needs must be one of {NEEDS}, got {needs!r}")
    options, fields = dict(options or {}), dict(fields or {})
    params = inspect.signature(fn).parameters
    for key in ("eps", "adv_clip", *options):
        if key not in params:
            raise ValueError(f"credit method {name!r}: its function takes no keyword {key!r}")
    unknown = set(fields) - set(options)
    if unknown:
        raise ValueError(f"credit method {name!r}: fields name options it does not have: {sorted(unknown)}")
    entry = Credit(fn, needs, options, fields)
    CREDITS[name] = entry
    ADVANTAGES[name] = fn
    return entry


register_credit("flow_grpo", flow_grpo, "final", {"global_std": False}, {"global_std": "global_std"})
register_credit("dense", dense, "states")
register_credit("stepwise", stepwise, "states", {"center": True})
register_credit(
    "turning_point",
    turning_point,
    "states",
    {"constrained": True, "first_step": True, "balance": "group"},
    {"constrained": "tp_constrained", "first_step": "tp_first_step", "balance": "tp_balance"},
)
register_credit(
    "coca",
    coca,
    "similarity",
    {"window": 1, "alpha": 0.0, "span": "trajectory", "renorm": "group", "global_std": False},
    {"global_std": "global_std"},
)
