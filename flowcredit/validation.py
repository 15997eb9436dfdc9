"""Checking a whole :class:`~flowcredit.config.Config`: ``validate`` rejects bad values and
inconsistent combinations with a message naming the field (it never silently corrects input);
``apply_overrides`` applies ``--key value`` pairs, then validates; ``credit_options`` resolves the
credit method's options, ``schedule_options``, ``weight_options`` and ``update_options`` those of the
step schedule, step weight and update rule; ``import_plugins`` imports the modules of ``--imports``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path

from flowcredit.advantages import CREDITS
from flowcredit.config import LOG_WITH, LORA_FORWARDS, TRAIN_PARAMS, Config, parse_value, trained_window
from flowcredit.errors import ConfigError, UserError
from flowcredit.guard_signals import GUARD_ACTIONS, MONITOR_RULES
from flowcredit.losses import KL_MODES
from flowcredit.models.registry import MODELS, VIDEO_MODELS, check_num_frames, is_model_spec
from flowcredit.rewards import REWARDS, parse_mix
from flowcredit.sde import LOGP_MODES, SAMPLER_ENTRIES
from flowcredit.step_schedules import STEP_SCHEDULES
from flowcredit.step_schedules import resolve_options as resolve_schedule_options
from flowcredit.step_weights import STEP_WEIGHTS
from flowcredit.tasks.prompt_sets import PROMPT_WEIGHTS
from flowcredit.updates import UPDATES
from flowcredit.updates import resolve_options as resolve_update_options
from flowcredit.values import ESTIMATORS


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ConfigError(name, message)


def credit_options(cfg: Config) -> dict:
    """The options of ``cfg.credit``'s function: each option's registered default, replaced by its own
    config field (built-in methods) or by ``credit_options``. Raises ``ConfigError`` naming an unknown
    or misspelt option, an option that has a field of its own, or a value of the wrong type."""
    entry = CREDITS[cfg.credit]
    try:
        given = json.loads(cfg.credit_options) if cfg.credit_options else {}
    except json.JSONDecodeError as exc:
        raise ConfigError("credit_options", f"not JSON ({exc.msg})") from None
    _check(isinstance(given, dict), "credit_options", "must be a JSON object of option: value")
    options = dict(entry.options)
    for key, field_name in entry.fields.items():
        options[key] = getattr(cfg, field_name)
    for key, value in given.items():
        known = ", ".join(sorted(entry.options)) or "none"
        _check(
            key in entry.options, "credit_options", f"{cfg.credit!r} has no option {key!r} (options: {known})"
        )
        _check(
            key not in entry.fields,
            "credit_options",
            f"set {cfg.credit!r}'s option {key!r} with its own field --{entry.fields.get(key)}",
        )
        default = entry.options[key]
        ok = isinstance(value, type(default)) or (isinstance(default, float) and type(value) is int)
        _check(
            default is None or ok,
            "credit_options",
            f"option {key!r} of {cfg.credit!r} must be {type(default).__name__}, got {value!r}",
        )
        options[key] = value
    return options


def _json_options(cfg: Config, field_name: str) -> dict:
    """The JSON object in config field ``field_name`` (empty: ``{}``); not JSON or not an object raise."""
    raw = getattr(cfg, field_name)
    try:
        given = json.loads(raw) if raw else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(field_name, f"not JSON ({exc.msg})") from None
    _check(isinstance(given, dict), field_name, "must be a JSON object of option: value")
    return given


def schedule_options(cfg: Config) -> dict:
    """The options of ``cfg.step_schedule`` (``window``'s start/size from ``window_start``/``window_size``),
    resolved and checked; errors name ``step_schedule_options`` (or the field that gives the option)."""
    _check(
        cfg.step_schedule in STEP_SCHEDULES,
        "step_schedule",
        f"{cfg.step_schedule!r} is not one of {sorted(STEP_SCHEDULES)}",
    )
    entry = STEP_SCHEDULES[cfg.step_schedule]
    given = _json_options(cfg, "step_schedule_options")
    for key, field_name in entry.fields.items():
        _check(
            key not in given, "step_schedule_options", f"set option {key!r} with its own field --{field_name}"
        )
        given[key] = getattr(cfg, field_name)
    try:
        return resolve_schedule_options("step schedule", cfg.step_schedule, entry, given)
    except ValueError as exc:
        fields = [f for k, f in entry.fields.items() if f"option {k!r}" in str(exc)]
        raise ConfigError(fields[0] if fields else "step_schedule_options", str(exc)) from None


def weight_options(cfg: Config) -> dict:
    """The options of ``cfg.step_weight``, resolved and checked (errors name ``step_weight_options``)."""
    _check(
        cfg.step_weight in STEP_WEIGHTS,
        "step_weight",
        f"{cfg.step_weight!r} is not one of {sorted(STEP_WEIGHTS)}",
    )
    try:
        return resolve_schedule_options(
            "step weight",
            cfg.step_weight,
            STEP_WEIGHTS[cfg.step_weight],
            _json_options(cfg, "step_weight_options"),
        )
    except ValueError as exc:
        raise ConfigError("step_weight_options", str(exc)) from None


def update_options(cfg: Config) -> dict:
    """The options of ``cfg.update`` (``clipped``'s clip range from ``clip_range``), resolved and checked
    (errors name ``update_options``). A ``clip_range`` set away from its default for a rule that does
    not read that field raises (:func:`_check_clip_range_field`)."""
    _check(cfg.update in UPDATES, "update", f"{cfg.update!r} is not one of {sorted(UPDATES)}")
    given = _json_options(cfg, "update_options")
    try:
        options = resolve_update_options(cfg.update, given, {"clip_range": cfg.clip_range})
    except ValueError as exc:
        raise ConfigError("update_options", str(exc)) from None
    _check_clip_range_field(cfg)
    return options


CLIP_RANGE_DEFAULT = Config.clip_range
"""``clip_range``'s default: any other value is a setting the update rule must read."""


def _check_clip_range_field(cfg: Config) -> None:
    """Refuse a ``--clip_range`` other than its default when ``cfg.update`` does not read that field
    (only ``clipped`` does): ``ratio_norm``'s range is its own option, on a ratio about ``s`` times
    smaller, and ``awm`` / ``nft`` clip no ratio, so the value would be ignored without a word."""
    rule = UPDATES[cfg.update]
    if cfg.clip_range == CLIP_RANGE_DEFAULT or "clip_range" in rule.fields:
        return
    if "clip_range" in rule.options:
        own = rule.options["clip_range"]
        fix = (
            f"update {cfg.update!r} does not read it: its clip range is its own option (default {own}), "
            f"set with --update_options '{{\"clip_range\": {cfg.clip_range}}}'"
        )
    else:
        fix = f"update {cfg.update!r} clips no ratio"
    raise ConfigError("clip_range", f"{cfg.clip_range}, but {fix}; leave clip_range at {CLIP_RANGE_DEFAULT}")


def _check_methods(cfg: Config) -> None:
    """The step schedule, step weight and update rule, and how they combine with the rest."""
    schedule_options(cfg)
    weight_options(cfg)
    update_options(cfg)
    rule, plain = UPDATES[cfg.update], cfg.step_schedule == "window"
    _check(cfg.train_guidance_scale >= 0, "train_guidance_scale", "must be >= 0 (0: the sampling one)")
    _check(
        rule.forward or not cfg.train_guidance_scale,
        "train_guidance_scale",
        f"{cfg.update!r} trains at the rollout's own (guided) velocities: set it for a forward-process rule",
    )
    if rule.forward:
        _check(
            cfg.credit == "flow_grpo",
            "update",
            f"{cfg.update!r} trains on the final sample with one advantage per sample: use credit=flow_grpo",
        )
        _check(cfg.step_weight == "uniform", "step_weight", f"{cfg.update!r} has no per-step loss to weight")
        _check(
            plain,
            "step_schedule",
            f"{cfg.update!r} trains on fresh noise, not on the rollout's steps: use 'window'",
        )
    if "mean" in rule.needs:
        _check(
            cfg.logp_mode == "gaussian", "logp_mode", f"{cfg.update!r} / {cfg.step_weight!r} need 'gaussian'"
        )
    if not plain:
        _check(
            not (cfg.calibrate or cfg.psi_path),
            "step_schedule",
            "DenseGRPO's ψ is calibrated on the fixed window: use step_schedule='window' with it",
        )


def _check_sampler(cfg: Config, start: int, size: int) -> None:
    """The sampler's own constraints (from its registry entry) on the window and the noise level."""
    entry = SAMPLER_ENTRIES[cfg.sampler]
    _check(
        entry.stochastic or (cfg.update in UPDATES and UPDATES[cfg.update].forward),
        "sampler",
        f"{cfg.sampler!r} has no noise, so nothing can be trained; use an SDE",
    )
    if entry.last_step_deterministic:
        _check(
            start + size < cfg.num_steps,
            "window_size",
            f"the last step of {cfg.sampler} is deterministic (σ' = 0) and cannot be trained",
        )
    if entry.first_step_deterministic:
        _check(
            start >= 1, "window_start", f"{cfg.sampler}'s first step (σ = 1) has std 0 and cannot be trained"
        )
    if entry.max_level is not None:
        _check(
            cfg.noise_level <= entry.max_level,
            "noise_level",
            f"{cfg.sampler} needs {entry.level_name} <= {entry.max_level:g}",
        )


def import_plugins(spec: str) -> None:
    """Import each module of the comma list ``spec`` (the ``imports`` field); idempotent."""
    for name in filter(None, (m.strip() for m in spec.split(","))):
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError("imports", f"cannot import {name!r} ({exc})") from None


def validate(cfg: Config) -> Config:
    """Raise ``ConfigError`` naming the field for bad values or inconsistent combinations."""
    import_plugins(cfg.imports)
    _check(
        cfg.sampler in SAMPLER_ENTRIES, "sampler", f"{cfg.sampler!r} is not one of {sorted(SAMPLER_ENTRIES)}"
    )
    _check(cfg.credit in CREDITS, "credit", f"{cfg.credit!r} is not one of {sorted(CREDITS)}")
    _check(cfg.estimator in ESTIMATORS, "estimator", f"{cfg.estimator!r} is not one of {sorted(ESTIMATORS)}")
    _check(cfg.logp_mode in LOGP_MODES, "logp_mode", f"{cfg.logp_mode!r} is not one of {LOGP_MODES}")
    _check(cfg.kl_mode in KL_MODES, "kl_mode", f"{cfg.kl_mode!r} is not one of {KL_MODES}")
    _check(cfg.train_params in TRAIN_PARAMS, "train_params", f"{cfg.train_params!r} not in {TRAIN_PARAMS}")
    _check(cfg.tp_balance in ("group", "none"), "tp_balance", "must be 'group' or 'none'")
    _check(
        cfg.prompt_weights in PROMPT_WEIGHTS,
        "prompt_weights",
        f"{cfg.prompt_weights!r} is not one of {sorted(PROMPT_WEIGHTS)}",
    )
    credit_options(cfg)
    _check_methods(cfg)
    _check(cfg.num_steps >= 2, "num_steps", "must be >= 2")
    _check(cfg.group_size >= 2, "group_size", "GRPO needs at least 2 samples per prompt")
    _check(cfg.prompts_per_iter >= 1, "prompts_per_iter", "must be >= 1")
    _check(cfg.noise_level > 0, "noise_level", "must be > 0 (0 is the ODE: nothing to train)")
    _check(cfg.batch_size >= 1, "batch_size", "must be >= 1")
    _check(cfg.substeps >= 1, "substeps", "must be >= 1")
    _check(cfg.clip_range > 0, "clip_range", "must be > 0")
    _check(cfg.lr > 0, "lr", "must be > 0")
    _check(cfg.beta >= 0, "beta", "must be >= 0")
    _check(cfg.guidance_scale >= 0, "guidance_scale", "must be >= 0 (0 keeps the model's default)")
    _check(0.0 <= cfg.ema_decay < 1.0, "ema_decay", "must be in [0, 1)")
    _check(cfg.steps_per_update >= 1, "steps_per_update", "must be >= 1")
    _check(cfg.iterations >= 0, "iterations", "must be >= 0")
    _check(cfg.snapshot_every >= 0, "snapshot_every", "must be >= 0 (0: no snapshots)")
    start, size = trained_window(cfg)
    _check(0 <= start < cfg.num_steps, "window_start", f"must lie in [0, {cfg.num_steps})")
    _check(
        size >= 1 and start + size <= cfg.num_steps,
        "window_size",
        f"window [{start}, {start + size}) must be non-empty and within the {cfg.num_steps} steps",
    )
    _check_sampler(cfg, start, size)
    _check(cfg.calib_flips >= 1, "calib_flips", "must be >= 1")
    _check(
        not cfg.calibrate or cfg.sampler == "dance_sde",
        "calibrate",
        "DenseGRPO's calibration sets dance_sde's per-step g: set sampler=dance_sde",
    )
    _check(
        not (cfg.calibrate and cfg.psi_path), "psi_path", "give either calibrate=true or psi_path, not both"
    )
    _check(
        not cfg.psi_path or cfg.sampler == "dance_sde", "psi_path", "a calibrated ψ needs sampler=dance_sde"
    )
    _check(not cfg.psi_path or Path(cfg.psi_path).is_file(), "psi_path", f"no file {cfg.psi_path!r}")
    _check(
        is_model_spec(cfg.model),
        "model",
        f"{cfg.model!r} is not one of {', '.join(MODELS)} nor 'pkg.mod:load'",
    )
    dtypes = ("auto", "float32", "bfloat16", "float16")
    _check(cfg.dtype in dtypes, "dtype", f"{cfg.dtype!r} is not one of {dtypes}")
    _check(cfg.resolution >= 0, "resolution", "must be >= 0")
    _check(cfg.max_sequence_length >= 0, "max_sequence_length", "must be >= 0 (0: the adapter's default)")
    _check(
        cfg.device == "cpu" or cfg.device.split(":")[0] == "cuda",
        "device",
        "must be 'cpu', 'cuda' or 'cuda:K'",
    )
    _check_video_and_eval(cfg)
    _check_scale_out(cfg)
    _check_guard(cfg)
    return cfg


def _check_guard(cfg: Config) -> None:
    """The reward-hacking guard's fields (docs/guard.md)."""
    _check(cfg.guard in GUARD_ACTIONS, "guard", f"{cfg.guard!r} is not one of {GUARD_ACTIONS}")
    _check(
        cfg.guard_monitor_rule in MONITOR_RULES,
        "guard_monitor_rule",
        f"{cfg.guard_monitor_rule!r} is not one of {sorted(MONITOR_RULES)}",
    )
    trained = parse_mix(cfg.reward) if cfg.guard != "off" else {}
    for name in [m.strip() for m in cfg.guard_monitors.split(",") if m.strip()]:
        _check(
            name in REWARDS or ":" in name,
            "guard_monitors",
            f"{name!r} is no registered reward ({', '.join(sorted(REWARDS))}) nor 'pkg.mod:fn'",
        )
        _check(name not in trained, "guard_monitors", f"{name!r} is trained on (reward {cfg.reward!r})")
    for name in ("guard_noise_mult", "guard_diversity_frac", "guard_saturation_delta", "guard_histogram_tv"):
        _check(getattr(cfg, name) >= 0, name, "must be >= 0 (0: off)")
    for name in ("guard_high_freq_ratio", "guard_drift_max", "guard_max_rollbacks"):
        _check(getattr(cfg, name) >= 0, name, "must be >= 0 (0: off)")
    _check(
        cfg.guard == "off" or cfg.eval_every > 0,
        "eval_every",
        f"the guard ({cfg.guard!r}) measures at evaluations: set eval_every > 0 (0: only start and end)",
    )
    _check(cfg.guard_patience >= 1, "guard_patience", "must be >= 1 (1: act at the first alarm)")
    _check(0 < cfg.guard_lr_scale <= 1, "guard_lr_scale", "must be in (0, 1]")
    _check(cfg.guard_beta_scale >= 1, "guard_beta_scale", "must be >= 1 (a rollback never loosens the KL)")
    _check(
        cfg.guard_beta_scale == 1 or cfg.beta > 0,
        "guard_beta_scale",
        "scales β, which is 0 here (the run keeps no reference policy): set beta > 0 or leave it at 1",
    )
    _check(
        cfg.guard == "off" or not cfg.guard_diversity_frac or cfg.eval_samples_per_prompt >= 2,
        "guard_diversity_frac",
        "measures the spread of a prompt's samples: needs eval_samples_per_prompt >= 2 (or 0: off)",
    )


def _check_video_and_eval(cfg: Config) -> None:
    """The video fields and the evaluation settings apart from training's."""
    _check(cfg.num_frames >= 0, "num_frames", "must be >= 0 (0: the model's default)")
    if cfg.model in MODELS:  # an import path's adapter is checked once loaded (load_model)
        check_num_frames(cfg.num_frames, cfg.model, cfg.model in VIDEO_MODELS)
    _check(cfg.reward_frame_stride >= 1, "reward_frame_stride", "must be >= 1 (1: every frame)")
    _check(cfg.eval_num_steps >= 0, "eval_num_steps", "must be >= 0 (0: num_steps)")
    _check(cfg.eval_guidance_scale >= 0, "eval_guidance_scale", "must be >= 0 (0: the training one)")


def _check_scale_out(cfg: Config) -> None:
    """``log_with`` and the wandb extra (``gradient_checkpointing`` is checked against the adapter)."""
    _check(cfg.log_with in LOG_WITH, "log_with", f"{cfg.log_with!r} is not one of {LOG_WITH}")
    _check(
        cfg.lora_forward in LORA_FORWARDS,
        "lora_forward",
        f"{cfg.lora_forward!r} is not one of {LORA_FORWARDS}",
    )
    _check(
        cfg.log_with != "wandb" or importlib.util.find_spec("wandb") is not None,
        "log_with",
        "'wandb' needs the wandb package: pip install 'flowcredit[wandb]'",
    )


def apply_overrides(cfg: Config, overrides: list[str] | None) -> Config:
    """Apply ``["--key", "value", …]`` to ``cfg`` (typed by the field), then :func:`validate`."""
    overrides = list(overrides or [])
    if len(overrides) % 2:
        raise UserError(f"overrides must come as '--key value' pairs, got {overrides}")
    for key, raw in zip(overrides[::2], overrides[1::2]):
        if not key.startswith("--"):
            raise UserError(f"expected '--key', got {key!r}")
        name = key[2:].replace("-", "_")
        setattr(cfg, name, parse_value(name, raw))
    return validate(cfg)
