"""The one training configuration: a typed dataclass with a one-line doc per field, and how values
reach it (``from_dict``, ``parse_value``: unknown keys and wrong types raise, naming the field;
``read_mapping``: a YAML or JSON config file, read errors naming the flag and the path).

Checking a whole config (``validate``, ``apply_overrides``) is in :mod:`flowcredit.validation`; the
presets and ``load_config`` (preset → YAML → overrides) are in :mod:`flowcredit.presets`.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path

from flowcredit.errors import ConfigError, PathError, UserError, existing, reading

TRAIN_PARAMS = ("lora", "text", "lora+text", "all")
LORA_FORWARDS = ("auto", "composed", "peft", "peft+copy")
LOG_WITH = ("tensorboard", "wandb", "none")


@dataclass
class Config:
    # --- run ---
    run_dir: str = "runs/demo"
    """Output directory; an existing one is never overwritten (use --resume)."""
    seed: int = 0
    """Seed of every random draw (prompts, initial noise, SDE noise, update order)."""
    iterations: int = 40
    """Number of GRPO iterations (rollout + update)."""
    max_minutes: float = 0.0
    """Stop after this many minutes of training (0: no limit); a checkpoint is written first."""
    threads: int = 2
    """torch intra-op threads (one per core here; one per rank under torchrun)."""
    device: str = "cpu"
    """Where the built-in model's network runs: 'cpu', 'cuda' or 'cuda:K' (sampler maths stay on the CPU)."""
    imports: str = ""
    """Comma list of Python modules imported before validation (they may register credit methods,
    samplers or presets: ``--imports my_methods --credit my_method``)."""
    # --- model ---
    model: str = "tiny"
    """Adapter: 'tiny' (built-in ShapeEval model), 'sd3' (SD3/SD3.5), 'flux' (FLUX.1), 'qwen_image',
    'wan' (Wan2.1 text-to-video), 'z_image' or 'pkg.mod:load'."""
    checkpoint: str = "builtin"
    """Base weights: 'builtin' (shipped tiny model), a checkpoint directory, or a diffusers hub id / dir."""
    resolution: int = 0
    """Image size in pixels for diffusers models (0: the model's default)."""
    dtype: str = "auto"
    """Weights dtype of diffusers models: auto, float32, bfloat16 or float16 (sampler maths stay fp32)."""
    autocast: bool = False
    """bf16 autocast for the network (tiny model; weights and sampler maths stay fp32; faster with AMX)."""
    guidance_scale: float = 0.0
    """Classifier-free guidance weight; 0 keeps the model's default."""
    max_sequence_length: int = 0
    """Text tokens of a diffusers adapter's prompt encoding (SD3/FLUX.1: T5; Qwen-Image, Z-Image: the
    LLM encoder; Wan: UMT5; docs/gpu.md), training and evaluation alike; 0: the adapter's default."""
    # --- task and reward ---
    reward: str = "shapes"
    """Reward: a registry name, 'pkg.mod:fn', or a weighted mix 'name=w,name=w'."""
    reward_options: str = ""
    """JSON of per-reward keyword options, e.g. '{"pickscore": {"model_dir": "/models/pickscore"}}'."""
    train_prompts: str = "train"
    """Training prompts: a ShapeEval split ('train', 'test') or a JSONL file."""
    num_train_prompts: int = 0
    """Use only the first k training prompts (0: all)."""
    prompt_weights: str = "uniform"
    """How training prompts are drawn: 'uniform' (every prompt alike) or 'category' (every category alike)."""
    eval_prompts: str = "test"
    """Held-out evaluation prompts: a split or a JSONL file."""
    num_eval_prompts: int = 16
    """Number of evaluation prompts, spread evenly over the set (0: all)."""
    # --- sampling ---
    num_steps: int = 10
    """Denoising steps N of a training rollout."""
    shift: float = 1.0
    """Schedule shift s (SD3.5: 3.0)."""
    sampler: str = "flow_sde"
    """Rollout sampler: a name of flowcredit.sde.SAMPLER_ENTRIES (ode, flow_sde, dance_sde, flash_sde, cps,
    ddim_sde)."""
    noise_level: float = 0.7
    """The sampler's noise parameter (a / eta / alpha) on SDE steps."""
    window_start: int = 0
    """First SDE (trained) step w."""
    window_size: int = 0
    """SDE steps K from window_start (0: every step but the last); other steps are ODE."""
    logp_mode: str = "gaussian"
    """'gaussian' (exact density, averaged over dims) or 'cps_mse' (Flow-GRPO's CPS surrogate)."""
    prompts_per_iter: int = 4
    """Prompt groups per iteration."""
    group_size: int = 16
    """Samples per prompt (the GRPO group)."""
    shared_noise: bool = False
    """All members of a group start from the same initial noise x_0."""
    batch_size: int = 64
    """Rows per model call in rollout and in the update (same geometry, so the first ratio is 1)."""
    # --- credit assignment ---
    credit: str = "flow_grpo"
    """Credit method: a name of flowcredit.advantages.CREDITS (flow_grpo, dense, stepwise, turning_point)."""
    credit_options: str = ""
    """JSON object of the credit method's own options, e.g. '{"temperature": 0.5}' (methods registered
    outside flowcredit; the built-in methods' options have fields of their own below)."""
    estimator: str = "ode_remaining"
    """State-value completion: a name of flowcredit.values.ESTIMATORS ('ode_remaining' or 'euler')."""
    substeps: int = 5
    """Euler sub-steps k of the 'euler' estimator."""
    global_std: bool = False
    """flow_grpo: divide by the batch std instead of the group std."""
    adv_clip: float = 5.0
    """Advantages are clipped to ±adv_clip."""
    adv_eps: float = 1e-4
    """eps in (x − mean)/(std + eps)."""
    tp_constrained: bool = True
    """turning_point: require sign(d_i) = sign(V_N − V_{i+1}) (TP-GRPO's consistency constraint)."""
    tp_first_step: bool = True
    """turning_point: apply the first-step rule."""
    tp_balance: str = "group"
    """turning_point: 'group' balancing of turning-point signs, or 'none'."""
    # --- which steps explore and train, how much each counts, and the update rule ---
    step_schedule: str = "window"
    """Which steps are SDE (explore) and trained each iteration: a name of
    flowcredit.step_schedules.STEP_SCHEDULES (window, mixgrpo, tempflow, egrpo)."""
    step_schedule_options: str = ""
    """JSON object of the step schedule's own options, e.g. '{"size": 4, "interval": 25}'."""
    step_weight: str = "uniform"
    """Per-step policy-loss weight: a name of flowcredit.step_weights.STEP_WEIGHTS (uniform, tempflow,
    grpo_guard)."""
    step_weight_options: str = ""
    """JSON object of the step weight's own options, e.g. '{"normalize": false}'."""
    update: str = "clipped"
    """Update rule: a name of flowcredit.updates.UPDATES (clipped, ratio_norm, awm, nft)."""
    update_options: str = ""
    """JSON object of the update rule's own options, e.g. '{"time_draws": 4}'."""
    train_guidance_scale: float = 0.0
    """Guidance weight of a forward-process rule's velocities in the update (0: the sampling one; 1: the
    conditional velocity alone, as DGPO's code)."""
    # --- DenseGRPO exploration-space calibration ---
    calibrate: bool = False
    """Calibrate per-step noise ψ before training (DenseGRPO; sampler must be 'dance_sde')."""
    calib_groups: int = 4
    """Prompt groups per calibration round."""
    calib_eps1: float = 2.0
    """Algorithm 1's balance threshold ε1 (counts)."""
    calib_eps2: float = 0.05
    """Algorithm 1's step ε2 on ψ."""
    calib_max_iters: int = 30
    """Cap on calibration rounds."""
    calib_flips: int = 3
    """Calibration stops once every trained ψ_i's update has changed direction this many times."""
    psi_path: str = ""
    """Reuse a calibrated ψ (psi.json from 'flowcredit calibrate') instead of calibrating."""
    # --- optimisation ---
    train_params: str = "lora"
    """What trains: 'lora' (velocity network), 'text' (text encoder), 'lora+text', or 'all'."""
    lora_rank: int = 4
    """LoRA rank r."""
    lora_alpha: float = 4.0
    """LoRA alpha (scale alpha/r)."""
    lora_targets: str = "default"
    """LoRA targets: 'default' (the adapter's), or a comma list of top modules ('unet,text') or suffixes."""
    lora_forward: str = "auto"
    """LoRA: 'composed' (W + s·B·A, one op), 'peft' (3 ops), 'peft+copy' (sampling: W + s·B·A copy), 'auto'"""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    clip_range: float = 1e-3
    """PPO clip ε on the ratio."""
    beta: float = 0.0
    """KL coefficient β to the reference policy."""
    kl_mode: str = "exact"
    """'exact' Gaussian KL or 'flow_grpo' (their g² normaliser)."""
    cfg_uncond_grad: bool = True
    """The update backpropagates through CFG's unconditional branch too (false: detached, as Flow-GRPO)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip."""
    inner_epochs: int = 1
    """Passes over the rollout per iteration."""
    steps_per_update: int = 3
    """Trained steps accumulated per optimizer step."""
    ema_decay: float = 0.0
    """EMA of trainable weights used for evaluation and the final export (0: off)."""
    skip_bad_rewards: bool = False
    """Drop groups with NaN/inf rewards (counted) instead of stopping with an error."""
    # --- video, and evaluation settings apart from training's ---
    num_frames: int = 0
    """Frames of a video model's clip (Wan: 4k + 1, e.g. 33 or 81; 0: the model's default)."""
    reward_frame_stride: int = 1
    """On video, an image reward scores every k-th frame (0, k, 2k, …) and averages them (1: all)."""
    eval_num_steps: int = 0
    """ODE steps of evaluation and of 'flowcredit eval/sample --config' (0: num_steps)."""
    eval_guidance_scale: float = 0.0
    """Guidance weight of evaluation (0: the training one, guidance_scale or the model's default)."""
    eval_reward: str = ""
    """Evaluation reward: a name, 'pkg.mod:fn' or a mix (empty: the training reward)."""
    # --- evaluation and checkpoints ---
    eval_every: int = 10
    """Evaluate every k iterations (and at the start and end); 0: only start and end."""
    eval_samples_per_prompt: int = 8
    """Samples per evaluation prompt (fixed initial noise)."""
    eval_seed: int = 1234
    """Seed of the evaluation noise (fixed for the whole run)."""
    save_every: int = 1
    """Write a checkpoint every k iterations."""
    snapshot_every: int = 0
    """Keep the exported weights every k iterations in run_dir/snapshots/iteration-K (0: none)."""
    # --- the reward-hacking guard (docs/guard.md) ---
    guard: str = "off"
    """On an alarm at an evaluation: 'warn' (log, mark), 'stop', 'rollback' (to best/); 'off': no signals."""
    guard_monitors: str = ""
    """Comma list of rewards scored on the held-out samples, never trained on; the first chooses best/."""
    guard_monitor_rule: str = "fall"
    """Monitor alarm: 'fall' (past the floors below its best) or 'hack' (only if the trained reward rose)."""
    guard_noise_mult: float = 4.0
    """A monitor alarm needs a fall of more than this many noise floors (the start's) below its best."""
    guard_patience: int = 2
    """The guard acts once this many evaluations in a row raised an alarm (1: at the first)."""
    guard_diversity_frac: float = 0.5
    """Diversity alarm below this fraction of its start (spread of a prompt's samples); 0: off."""
    guard_saturation_delta: float = 0.15
    """Saturation alarm when the mean HSV saturation moves further than this from its start; 0: off."""
    guard_histogram_tv: float = 0.25
    """Colour alarm when the colour histogram's total-variation distance from the start's passes this."""
    guard_high_freq_ratio: float = 2.0
    """Artefact alarm when the high-frequency energy share passes this multiple of its start; 0: off."""
    guard_drift_max: float = 0.0
    """Drift alarm when the trained weights' relative distance from the start passes this; 0: off."""
    guard_lr_scale: float = 0.5
    """rollback: the learning rate is multiplied by this at each rollback."""
    guard_beta_scale: float = 1.0
    """rollback: β is multiplied by this at each rollback (other than 1: needs beta > 0)."""
    guard_max_rollbacks: int = 3
    """rollback: after this many rollbacks, the next alarm stops the run."""
    # --- scale-out: tracker, memory, compilation (docs/gpu.md) ---
    log_with: str = "tensorboard"
    """Tracker beside metrics.jsonl (always written): 'tensorboard' (run_dir/tb), 'wandb' (scalars,
    evaluation grids, config; the extra flowcredit[wandb]) or 'none'."""
    gradient_checkpointing: bool = False
    """Recompute the transformer blocks' activations in the backward pass (diffusers adapters):
    less memory, more compute."""
    compile: bool = False
    """torch.compile the velocity network (the adapter's ``net``); needs a C compiler on the CPU."""
    text_encoders: str = "device"
    """Diffusers text encoders: 'device' (beside the transformer), 'offload' (on the host, on the device
    while encoding) or 'cpu' (encode on the host); off 'device', encodings are cached per prompt."""
    decode_chunk: int = 0
    """Rows per VAE decode (0: the adapter's default, 8 for diffusers); fewer: less memory."""
    base_quantization: str = "none"
    """Frozen transformer-block weights in 8 bits (torchao; flowcredit[quant]): 'none', 'float8' or
    'int8'. Changes the numbers (LoRA trains on the rounded base); never a default."""


def _field_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(Config)
    return hints[f.name]


def unknown_key(name: str, fields) -> str:
    """The message for a key that is no config field: the closest fields ("did you mean"), else all."""
    import difflib

    close = difflib.get_close_matches(name, sorted(fields), n=3, cutoff=0.7)
    if close:
        return f"unknown config key {name!r}; did you mean {' or '.join(map(repr, close))}?"
    return f"unknown config key {name!r}; valid keys: {', '.join(sorted(fields))}"


def parse_value(name: str, raw: str):
    """Convert a command-line string to the type of field ``name``."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if name not in fields:
        raise UserError(unknown_key(name, fields))
    kind = _field_type(fields[name])
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if kind in (int, float, str):
            return kind(raw)
    except ValueError:
        raise ConfigError(name, f"cannot read {raw!r} as {kind.__name__}") from None
    raise ConfigError(name, "cannot be set from the command line")


def from_dict(values: dict, base: Config | None = None) -> Config:
    """A Config from ``base`` with ``values`` applied; unknown keys and wrong types raise."""
    cfg = dataclasses.replace(base or Config())
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for key, value in values.items():
        if key not in fields:
            raise UserError(unknown_key(key, fields))
        kind = _field_type(fields[key])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(key, f"must be {kind.__name__}, got {value!r}")
        setattr(cfg, key, value)
    return cfg


def trained_window(cfg: Config) -> tuple[int, int]:
    """(w, K) of the SDE window: ``window_size`` 0 means every step from w but the last."""
    size = cfg.window_size or cfg.num_steps - 1 - cfg.window_start
    return cfg.window_start, size


def read_mapping(what: str, path: str | Path) -> dict:
    """The config keys in the YAML or JSON file ``path`` (``--config``, a run's ``config.json``): a
    ``.json`` file is read as JSON (YAML 1.1 would read ``1e-05`` as a string), any other as YAML. A
    missing file, one that does not parse, or one that is not a mapping is a one-line
    :class:`~flowcredit.errors.PathError` naming ``what`` (the flag) and the path; an empty file is ``{}``."""
    file = existing(what, path, "file")
    with reading(what, path):
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".json":
            data = json.loads(text) if text.strip() else {}
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise PathError(what, path, f"expected a mapping of config keys, got a {type(data).__name__}")
    return data
