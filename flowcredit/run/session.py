"""What a training run holds between iterations, built whole by :func:`build_session`.

``build_session`` makes the model adapter (or takes an injected one), the policy (LoRA / trainable
set / reference), the optimizer, EMA, the schedule, the SDE window, the reward (or an injected one)
and the prompt sets, and restores a checkpoint when resuming. DenseGRPO's ψ comes from the checkpoint,
from ``psi_path``, or from calibration, which ``flowcredit.train.train`` runs explicitly
(``flowcredit.run.calibrate``); until then ``psi`` is None and every trained step uses ``noise_level``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flowcredit.advantages import CREDITS, Credit
from flowcredit.config import Config
from flowcredit.errors import ConfigError, UserError, reading
from flowcredit.models import FlowModel, check_adapter, load_model
from flowcredit.models.memory_options import apply_memory_options
from flowcredit.models.registry import apply_text_length
from flowcredit.rewards import Reward, check_metadata, get_reward, parse_mix, uses_shapeeval
from flowcredit.run.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from flowcredit.run.distributed import Dist
from flowcredit.run.guard import Guard, monitor_names
from flowcredit.run.lora_compose import compose_lora, lora_forwards, sampling_copies
from flowcredit.run.policy import EMA, Policy
from flowcredit.run.psi_file import read_psi, write_psi
from flowcredit.run.rollout import Batch, draw_batch, noise_levels
from flowcredit.run.sharding import full_dict, full_optimizer_state, shard_like, shard_optimizer_state
from flowcredit.sde import SAMPLERS, StepFn
from flowcredit.tasks.prompt_sets import PROMPT_WEIGHTS, load_prompt_set
from flowcredit.updates import UPDATES, Update
from flowcredit.validation import credit_options, update_options


@dataclass
class Session:
    """A run's state. ``trained (N,)`` marks the SDE window; ``psi (N,)`` is DenseGRPO's calibrated
    noise (None: ``noise_level`` on every trained step); ``eval_reward`` is ``cfg.eval_reward``'s
    (None: evaluation scores with ``reward``); ``history`` keeps run-level numbers (noise floors)
    across resumes."""

    cfg: Config
    run_dir: Path
    dist: Dist
    model: FlowModel
    policy: Policy
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    reward: Reward
    sigmas: torch.Tensor
    trained: torch.Tensor
    train_metas: list[dict]
    eval_metas: list[dict]
    psi: torch.Tensor | None = None
    old: EMA | None = None
    """The old policy of a forward-process update rule (``Update.old_decay``): a soft-updated copy of
    the trainable weights, swapped in for its velocity (and, for DiffusionNFT, for sampling)."""
    eval_reward: Reward | None = None
    sampling_copies: bool = False
    """Whether the rollout runs the LoRA layers on a copy of their composed weights (lora_forwards)."""
    start_iteration: int = 0
    history: dict = field(default_factory=dict)
    guard: Guard | None = None
    """The reward-hacking guard (``cfg.guard`` other than 'off'; docs/guard.md)."""

    @property
    def step_fn(self) -> StepFn:
        return SAMPLERS[self.cfg.sampler]

    @property
    def credit(self) -> Credit:
        return CREDITS[self.cfg.credit]

    @property
    def credit_kwargs(self) -> dict:
        """Keywords of this run's advantage function: the shared ``eps``/``adv_clip`` and its own options."""
        return {"eps": self.cfg.adv_eps, "adv_clip": self.cfg.adv_clip, **credit_options(self.cfg)}

    @property
    def update(self) -> Update:
        return UPDATES[self.cfg.update]

    @property
    def update_opts(self) -> dict:
        """The update rule's options (defaults, ``clip_range`` from its field, ``update_options``)."""
        return update_options(self.cfg)

    @contextlib.contextmanager
    def sampling_policy(self):
        """The context the rollout samples in: the old policy for a rule that samples with it
        (DiffusionNFT), the current one otherwise; with ``sampling_copies`` (:func:`lora_forwards`),
        each LoRA layer runs one op with ``W + s·B·A`` computed once for the rollout
        (:func:`flowcredit.run.lora_compose.sampling_copies`; base weights untouched)."""
        with contextlib.ExitStack() as stack:
            if self.update.samples_with == "old":
                stack.enter_context(self.old.applied())
            if self.sampling_copies:
                stack.enter_context(sampling_copies(self.model.net))
            yield

    @property
    def levels(self) -> torch.Tensor:
        """``(N,)`` sampler level of each step (0 outside the window; ψ_i inside it once calibrated)."""
        return noise_levels(self.cfg, self.psi)[0]

    @property
    def rollout_opts(self) -> dict:
        """The keyword options of :func:`flowcredit.run.rollout.rollout`: ``logp_mode``, ``batch_size``,
        and ``keep_velocity`` when the method's values are one-step (``euler``, k = 1), which then
        reuse the rollout's velocities (no model call of their own)."""
        cfg = self.cfg
        one_step = self.credit.needs == "states" and cfg.estimator == "euler" and cfg.substeps == 1
        opts = {"logp_mode": cfg.logp_mode, "batch_size": cfg.batch_size, "keep_velocity": one_step}
        if self.reuses_uncond:
            opts["keep_uncond"] = True
        return opts | ({"keep_mean": True} if "mean" in self.update.needs else {})

    @property
    def reuses_uncond(self) -> bool:
        """Whether the update's first pass takes CFG's unconditional velocity from the rollout
        (``keep_uncond``): ``cfg_uncond_grad`` off (the branch is then a constant of the gradient),
        CFG on, an adapter with ``uncond_record`` (:class:`flowcredit.models.FlowModelBase`), the
        PPO update, sampled with the current policy."""
        cfg, model = self.cfg, self.model
        on = not cfg.cfg_uncond_grad and self.guidance_passes == 2
        on = on and hasattr(model, "uncond_record") and not self.update.forward
        return on and self.update.samples_with != "old"

    @property
    def value_opts(self) -> tuple[str, torch.Tensor, str, int]:
        """``(needs, trained, estimator, substeps)`` of :func:`flowcredit.run.rollout.state_values`."""
        return self.credit.needs, self.trained, self.cfg.estimator, self.cfg.substeps

    def draw(self, iteration: int) -> Batch:
        """This iteration's prompts and initial noise on this rank (:func:`draw_batch`)."""
        c, shape = self.cfg, tuple(self.model.latent_shape)
        world, rank = self.dist.world, self.dist.rank
        return draw_batch(
            self.train_metas,
            c.prompts_per_iter,
            c.group_size,
            shape,
            c.shared_noise,
            c.seed,
            iteration,
            world,
            rank,
            PROMPT_WEIGHTS[c.prompt_weights](self.train_metas),
        )

    def named_reward(self, spec: str) -> Reward:
        """The reward ``spec`` (a monitor, the evaluation reward) with its own ``reward_options`` entries."""
        return build_reward(self.cfg, spec, named_only=True)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.policy.parameters()

    @property
    def guidance_passes(self) -> int:
        return self.model.guidance_passes

    def save(self, iteration: int, folder: Path | None = None) -> None:
        """Atomic checkpoint of everything a resume needs (``run_dir/checkpoint``, or ``folder``), written
        by rank 0. Under FSDP every rank calls it (the full tensors are gathered collectively); the files
        are a 1-process run's."""
        if not (self.dist.is_main or self.dist.sharded):
            return
        ema, old = (
            None if e is None else {f"{i:05d}": t for i, t in enumerate(e.shadow)}
            for e in (self.ema, self.old)
        )
        trainable, optimizer = self.policy.trainable_state(), self.optimizer.state_dict()
        if self.dist.sharded:
            trainable, optimizer = full_dict(trainable), full_optimizer_state(optimizer)
            ema, old = (None if e is None else full_dict(e) for e in (ema, old))
        if not self.dist.is_main:
            return
        extra = {"psi": None if self.psi is None else self.psi.tolist(), "history": self.history}
        folder = folder or self.run_dir / "checkpoint"
        save_checkpoint(
            folder.parent,
            iteration=iteration,
            trainable=trainable,
            optimizer=optimizer,
            ema=ema,
            extra=extra,
            old=old,
            name=folder.name,
        )

    def restore(self, state: dict) -> None:
        """Load a checkpoint into the training state (:meth:`restore_training`), with its ψ, history
        and iteration."""
        self.restore_training(state)
        extra = state["extra"]
        self.psi = torch.tensor(extra["psi"]) if extra.get("psi") is not None else None
        self.history = extra.get("history", {})
        self.start_iteration = state["iteration"]

    def restore_training(self, state: dict) -> None:
        """Load a checkpoint's tensors (full tensors, read by every rank) into the prepared network,
        optimizer, EMA and old policy: each rank keeps its shards under FSDP."""
        self.policy.load_trainable_state(state["trainable"])
        optimizer = state["optimizer"]
        if self.dist.sharded:
            optimizer = shard_optimizer_state(self.optimizer, optimizer)
        self.optimizer.load_state_dict(optimizer)
        for kept, saved in ((self.ema, state["ema"]), (self.old, state.get("old"))):
            if kept is not None and saved is not None:
                for shadow, name in zip(kept.shadow, sorted(saved)):
                    shadow.copy_(shard_like(saved[name], shadow))


def prepare_run_dir(cfg: Config, dist: Dist, resume: bool) -> Path:
    """Create ``cfg.run_dir`` (rank 0) and write ``config.json``; a non-empty one needs ``resume``."""
    run_dir = Path(cfg.run_dir)
    if dist.is_main:
        if not resume and run_dir.exists() and any(run_dir.iterdir()):
            if find_checkpoint(run_dir) is None:
                raise UserError(
                    f"run_dir {str(run_dir)!r} is not empty but holds no checkpoint to resume (a run that "
                    "stopped in its first iteration?): delete it or choose another --run_dir"
                )
            raise UserError(
                f"run_dir {str(run_dir)!r} exists and is not empty; use "
                f"'flowcredit train --resume {run_dir}' or another --run_dir"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    dist.barrier()
    return run_dir


def build_session(
    cfg: Config, resume: bool = False, *, model: FlowModel | None = None, reward: Reward | None = None
) -> Session:
    """The whole run: ``model`` and ``reward`` are built from ``cfg`` unless given (benchmarks and
    tests inject them). Resuming restores the latest checkpoint of ``cfg.run_dir``."""
    dist = Dist()
    torch.set_num_threads(cfg.threads if dist.world == 1 else max(1, cfg.threads // dist.world))
    if cfg.prompts_per_iter % dist.world:
        raise UserError(
            f"config field 'prompts_per_iter' ({cfg.prompts_per_iter}) must be divisible "
            f"by the number of processes ({dist.world})"
        )
    created = not Path(cfg.run_dir).exists()
    run_dir = prepare_run_dir(cfg, dist, resume)
    try:
        return _assemble(cfg, dist, run_dir, resume, model, reward)
    except BaseException:
        if not resume and dist.is_main:  # a failed start leaves nothing that blocks the same command
            (run_dir / "config.json").unlink(missing_ok=True)
            if created and not any(run_dir.iterdir()):
                run_dir.rmdir()
        raise


def _assemble(cfg: Config, dist: Dist, run_dir: Path, resume: bool, model, reward) -> Session:
    """The model, policy, optimizer, EMA, reward, prompt sets and restored state of :func:`build_session`."""
    if model is None:
        model = load_model(cfg)
    else:
        check_adapter(model, type(model).__name__)
        apply_memory_options(cfg, model)
    check_frame_stride(cfg.reward_frame_stride, getattr(model, "num_frames", 0))
    policy = Policy(
        model,
        cfg.train_params,
        cfg.lora_rank,
        cfg.lora_alpha,
        cfg.lora_targets,
        need_reference=cfg.beta > 0,
        seed=cfg.seed,
    )
    configure_network(cfg, model)
    params = policy.parameters()
    shapes = uses_shapeeval(cfg.reward)  # ShapeEval rewards score from ShapeEval metadata: check it up front
    eval_shapes = uses_shapeeval(cfg.eval_reward or cfg.reward)
    s = Session(
        cfg=cfg,
        run_dir=run_dir,
        dist=dist,
        model=model,
        policy=policy,
        optimizer=torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
        ema=None,
        reward=reward or build_reward(cfg, cfg.reward),
        sigmas=model.sigmas(cfg.num_steps, cfg.shift),
        trained=noise_levels(cfg, None)[1],
        train_metas=load_prompt_set(
            cfg.train_prompts, cfg.num_train_prompts, False, shapes, "config field 'train_prompts'"
        ),
        eval_metas=load_prompt_set(
            cfg.eval_prompts, cfg.num_eval_prompts, True, eval_shapes, "config field 'eval_prompts'"
        ),
        eval_reward=build_reward(cfg, cfg.eval_reward, named_only=True) if cfg.eval_reward else None,
    )
    check_metadata(s.reward, s.train_metas, cfg.train_prompts)
    check_metadata(s.eval_reward or s.reward, s.eval_metas, cfg.eval_prompts)
    # FSDP2 replaces the parameters by DTensor shards: the EMA and the restore come after prepare
    s.optimizer = dist.prepare(model.net, s.optimizer, model.fsdp_block_classes)
    composed, s.sampling_copies = lora_forwards(cfg, model, dist.sharded)
    if composed:
        compose_lora(model.net)
    s.ema = EMA(s.params, cfg.ema_decay) if cfg.ema_decay else None
    s.old = EMA(s.params, 0.0) if s.update.old_decay is not None else None
    ckpt = find_checkpoint(run_dir) if resume else None
    if resume and ckpt is None:
        raise UserError(f"--resume {str(run_dir)!r}: no checkpoint in that run directory")
    if ckpt is not None:
        with reading("--resume", run_dir, ckpt.name):  # a state cut short: one line, not a traceback
            state = load_checkpoint(ckpt)
        s.restore(state)
    elif cfg.psi_path:
        s.psi = read_psi(cfg.psi_path, cfg.num_steps)
    if s.psi is not None:
        write_psi(s)
    s.guard = Guard(s) if cfg.guard != "off" else None  # after the restore: it keeps its state
    return s


def check_frame_stride(stride: int, num_frames: int) -> None:
    """An image reward on clips scores frames ``0, k, 2k, …``: a stride past the clip scores frame 0 only."""
    if num_frames > 1 and stride >= num_frames:
        raise ConfigError(
            "reward_frame_stride",
            f"{stride} ≥ the clip's {num_frames} frames: only frame 0 would be scored; "
            f"use at most {num_frames - 1}",
        )


def build_reward(cfg: Config, spec: str, named_only: bool = False) -> Reward:
    """The reward ``spec`` with ``cfg.reward_options`` and ``cfg.reward_frame_stride``. ``named_only``
    (the evaluation reward, the guard's monitors): only the entries of rewards in ``spec``; the
    training reward takes every entry but those of the evaluation reward and the monitors, so a
    misspelt name is an error."""
    options = json.loads(cfg.reward_options) if cfg.reward_options else {}
    mine = parse_mix(spec)
    others = set(parse_mix(cfg.eval_reward) if cfg.eval_reward else {}) | set(monitor_names(cfg))
    if named_only:
        options = {k: v for k, v in options.items() if k in mine}
    else:
        options = {k: v for k, v in options.items() if k in mine or k not in others}
    return get_reward(spec, options or None, cfg.reward_frame_stride)


def configure_network(cfg: Config, model: FlowModel) -> None:
    """``gradient_checkpointing`` through the adapter, ``compile`` by ``nn.Module.compile`` (in place:
    parameter names, LoRA layers and checkpoints stay as they are); the text length and the CFG
    gradient (``max_sequence_length``, ``cfg_uncond_grad``) also onto a model given to
    :func:`build_session` rather than loaded from ``cfg``."""
    apply_text_length(cfg, model)
    set_cfg_uncond_grad(cfg.cfg_uncond_grad, model)
    if cfg.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    if cfg.compile:
        on_cpu = next(model.net.parameters()).device.type == "cpu"
        if on_cpu and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
            raise ConfigError(
                "compile", "torch.compile on the CPU needs a C++ compiler (g++ or clang++) on PATH"
            )
        model.net.compile()


def set_cfg_uncond_grad(on: bool, model: FlowModel) -> None:
    """``cfg_uncond_grad`` onto the adapter (:meth:`FlowModelBase.uncond_branch`); ``False`` on an adapter
    without the switch raises, as it would otherwise train through both branches unnoticed."""
    if hasattr(model, "cfg_uncond_grad"):
        model.cfg_uncond_grad = on
    elif not on:
        raise ConfigError(
            "cfg_uncond_grad",
            f"the {type(model).__name__} adapter cannot detach its unconditional branch "
            "(subclass flowcredit.models.FlowModelBase and pass it through uncond_branch)",
        )
