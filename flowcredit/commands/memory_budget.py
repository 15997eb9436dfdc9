"""``flowcredit memory --memory_budget 24GiB``: the settings that fit a GPU, chosen on the fake real-size
model (:mod:`flowcredit.commands.memory_plan`), and what they cost in time (docs/gpu.md, "Will it fit?").

The plan adds options one at a time, in :data:`PLAN_STEPS` order (cheapest in time first), until every
phase's predicted peak fits the budget less :data:`HEADROOM` (the CUDA context, cuBLAS workspaces and
fragmentation, which the count leaves out). Each option keeps the numbers (tests/test_memory_options.py),
but ``base_quantization``, which changes them and is tried only with ``allow_quantization``. When
nothing fits, :class:`~flowcredit.errors.ConfigError` names the phase that does not.

The time cost is counted, not measured: the extra passes and copies each option adds per iteration
against the settings as given (the "80 GiB settings"). A transformer backward counts as two forwards;
host↔device copies at :data:`LINK_GB_S`; the reward on the CPU counts its image-tower forwards.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

from flowcredit.commands.memory_plan import PHASES
from flowcredit.config import Config
from flowcredit.errors import ConfigError

GIB = 2**30
HEADROOM = 2 * GIB
"""Budget kept free for what the count leaves out (CUDA context ≈ 0.5 GiB, cuBLAS workspaces, the
allocator's fragmentation); the 2026-11-29 check measured 49.9 GiB against a counted 50.4."""
LINK_GB_S = 25.0
"""Host↔device copy rate assumed for the time cost (PCIe 4.0 ×16, pinned memory: ≈ 25 GB/s)."""
PLAN_STEPS = (
    ("text_encoders", "offload"),
    ("decode_chunk", 4),
    ("gradient_checkpointing", True),
    ("decode_chunk", 2),
    ("reward_offload", True),
    ("decode_chunk", 1),
    ("batch_size", "halve"),
    ("base_quantization", "float8"),
    ("text_encoders", "cpu"),
)
"""The options the plan adds, in order; ``batch_size`` halves (rows per model call: the group is reached
by accumulation either way) as often as it helps."""
ALL_BUT = {p: tuple(q for q in PHASES if q != p) for p in PHASES}
HELPS = {
    "text_encoders": {"offload": ALL_BUT["text_encoding"], "cpu": ("text_encoding",)},
    "decode_chunk": ("values", "reward", "evaluation"),
    "gradient_checkpointing": ("update",),
    "reward_offload": ALL_BUT["reward"],
    "batch_size": ("rollout", "values", "update", "evaluation"),
    "base_quantization": PHASES,
}
"""The phases whose peak each option lowers: the plan takes the next option that helps the phase that
does not fit."""


def helps(field: str, value, phase: str) -> bool:
    phases = HELPS[field]
    return phase in (phases[value] if isinstance(phases, dict) else phases)


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"24 GiB"``, ``"24GB"`` (taken as GiB, as GPUs are sold), ``"80"`` (GiB) → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(gib|gb|g)?\s*", str(text).lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError("memory_budget", f"{text!r}: a size in GiB such as '24GiB'")
    return int(float(m.group(1)) * GIB)


def reward_options_with(cfg: Config, **options) -> str:
    """``cfg.reward_options`` with ``options`` set for ``cfg.reward``."""
    current = json.loads(cfg.reward_options) if cfg.reward_options else {}
    current[cfg.reward] = {**current.get(cfg.reward, {}), **options}
    return json.dumps(current, sort_keys=True)


def next_setting(cfg: Config, field: str, value, has_reward_network: bool) -> Config | None:
    """``cfg`` with one more plan step, or None where it changes nothing (or does not apply)."""
    if field == "reward_offload":
        if not has_reward_network or '"offload": true' in cfg.reward_options:
            return None
        return replace(cfg, reward_options=reward_options_with(cfg, offload=True))
    if field == "batch_size":
        return replace(cfg, batch_size=cfg.batch_size // 2) if cfg.batch_size > 1 else None
    if field == "decode_chunk":
        current = cfg.decode_chunk or 8
        return replace(cfg, decode_chunk=value) if value < current else None
    if getattr(cfg, field) == value or (field == "text_encoders" and cfg.text_encoders == "cpu"):
        return None
    return replace(cfg, **{field: value})


def fit(cfg: Config, budget: int, size: str = "medium", tiny_text: bool = False, allow_quantization=False):
    """The first plan of :data:`PLAN_STEPS` whose every phase fits ``budget − HEADROOM`` bytes:
    ``{"budget", "headroom", "changes": {field: value}, "estimate", "tried": [...], "time_cost"}``; raises
    ``ConfigError('memory_budget', …)`` naming the phase that does not fit with every option."""
    from flowcredit.commands.memory_plan import build, settings_of

    limit = budget - HEADROOM
    built = build(cfg, size, tiny_text)
    current = built.cfg
    result, tried = _run(built, cfg, current, [])
    while result["peak"] > limit:
        step = _next_step(current, result, built, allow_quantization)
        if step is None:
            break
        field, following = step
        current = following
        if field == "base_quantization":  # a new base: build again
            built = build(current, size, tiny_text)
        result, tried = _run(built, cfg, current, tried)
    if result["peak"] > limit:
        phase, peak = result["peak_phase"], result["peak"] / GIB
        hint = "" if allow_quantization else "; an 8-bit base may fit: --allow_quantization"
        raise ConfigError(
            "memory_budget",
            f"{budget / GIB:.0f} GiB: the {phase} phase needs {peak:.1f} GiB (+{HEADROOM / GIB:.0f} GiB "
            f"headroom) with every option ({', '.join(changes(cfg, current)) or 'none'}){hint}",
        )
    return dict(
        budget=budget,
        headroom=HEADROOM,
        changes=changes(cfg, current),
        estimate=result | {"settings": settings_of(built, current)},
        tried=tried,
        time_cost=time_cost(cfg, current, built),
    )


def _next_step(current: Config, result: dict, built, allow_quantization: bool):
    """``(field, the next Config)`` of the first plan step that helps the peak phase, or None."""
    for field, value in PLAN_STEPS:
        if field == "base_quantization" and not allow_quantization:
            continue
        following = next_setting(current, field, value, built.reward is not None)
        if following is not None and helps(field, value, result["peak_phase"]):
            return field, following
    return None


def _run(built, given: Config, current: Config, tried: list) -> tuple[dict, list]:
    """The estimate of ``current`` on ``built`` and ``tried`` with its line."""
    from flowcredit.commands.memory_models import reward_placement
    from flowcredit.commands.memory_plan import run_phases

    if built.reward is not None:
        built.reward.placement = reward_placement(current)
    result = run_phases(current, built.model, built.policy, built.reward)
    line = dict(changes=changes(given, current), peak=result["peak"], peak_phase=result["peak_phase"])
    return result, [*tried, line]


def changes(before: Config, after: Config) -> dict:
    """``{field: new value}`` of every field that differs."""
    return {k: v for k, v in vars(after).items() if vars(before)[k] != v}


def time_cost(base: Config, plan: Config, built) -> dict:
    """The passes and copies ``plan`` adds per iteration against ``base`` (module docstring): transformer
    forwards (checkpointing's recompute), model calls (a smaller batch), VAE calls (a smaller decode
    chunk), bytes across the host link, and the compute ratio (forward = 1, backward = 2)."""
    from flowcredit.commands.bench_skill import nfe_parts
    from flowcredit.commands.memory_count import storage_bytes
    from flowcredit.models.memory_options import text_encoder_modules

    rows = base.prompts_per_iter * base.group_size
    passes = built.model.guidance_passes
    nfe = {k: v * rows * passes for k, v in nfe_parts(base).items()}  # transformer rows per iteration
    compute = nfe["rollout"] + nfe["values"] + 3 * nfe["update"]
    recompute = nfe["update"] if plan.gradient_checkpointing and not base.gradient_checkpointing else 0
    steps = sum(nfe_parts(base).values())  # model calls per row
    calls = {c.batch_size: math.ceil(rows / c.batch_size) * steps for c in (base, plan)}
    decodes = {c: math.ceil(rows / c) for c in (base.decode_chunk or 8, plan.decode_chunk or 8)}
    link = 0
    if plan.text_encoders == "offload" and base.text_encoders == "device":
        link += 2 * storage_bytes(*text_encoder_modules(built.model.pipe))  # there and back per encoding
    reward = built.reward
    if reward is not None and reward.placement == "offload" and '"offload": true' not in base.reward_options:
        link += 2 * storage_bytes(*reward.modules)  # per scoring call
    return dict(
        transformer_forwards_added=recompute,
        compute_ratio=(compute + recompute) / compute,
        model_calls=[calls[base.batch_size], calls[plan.batch_size]],
        vae_calls=[decodes[base.decode_chunk or 8], decodes[plan.decode_chunk or 8]],
        host_link_bytes=link,
        host_link_seconds=link / (LINK_GB_S * 1e9),
        base_quantization=plan.base_quantization,
    )
