"""Per-phase GPU memory of a training run, predicted on the CPU with no GPU and no weights
(``flowcredit memory``; docs/gpu.md, "Will it fit?").

The real-size pipeline (SD3.5-Medium / -Large or FLUX.1-dev: transformer, VAE and text encoders, built
from their hub configs, below) is constructed on *fake* tensors (``FakeTensorMode``: shapes, dtypes and
storages, no data), the LoRA is injected by the trainer's own :class:`~flowcredit.run.policy.Policy`, and
each phase runs the library's own code on it: the adapter's ``encode`` (text encoders) and ``velocity``,
the sampler step, :func:`flowcredit.run.rollout.chunked_velocity` under the merged policy for the values,
the adapter's ``decode`` for the reward, :func:`flowcredit.train.step_loss` (forward + backward of one
update micro-batch) and the optimizer step. A ``TorchDispatchMode`` (:class:`LiveStorages`) counts the
bytes of every storage an op creates while it is referenced; its peak is the phase's transient peak.

Per phase, in bytes: ``weights`` (every pipeline module's parameters and buffers, resident all the run,
as the trainer keeps them), ``gradients`` (the trainable tensors' accumulated gradients, update only),
``optimizer`` (AdamW's state after a step, resident from the first update on), ``activations`` (what the
update's forward saves for its backward, measured with ``saved_tensors_hooks``) and ``temporaries``
(the rest of the phase's peak); ``peak`` is their sum. Not counted: the CUDA context and cuBLAS
workspaces (a few hundred MiB outside ``max_memory_allocated``), the allocator's fragmentation, and the
reward model (rewards other than ``jpeg_*`` and the built-in ones run a network of their own).

Three traps (issue 57): modules are built on fake **CPU** tensors with the default dtype set before
construction (fake CUDA fails at random initialisation on a CPU-only torch; a fake parameter cannot be
swapped by ``Module.to``, so ``to`` is a no-op while building); torch's ``MemTracker`` stops on frozen
parameters, hence our own counter; and the attention kernel the fake run dispatches decides what the
backward saves, so it is reported (``attention_kernel``): on the CPU, torch dispatches its fused flash
kernel (saving the output and an O(N) logsumexp, as CUDA's flash and memory-efficient kernels do); if
the math kernel ran instead, the saved N×N probabilities are taken out (``attention_correction``).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from flowcredit.commands.memory_count import LiveStorages, saved_for_backward, storage_bytes, storage_keys
from flowcredit.commands.memory_models import (
    PROMPT,
    SIZES,
    build_fake_model,
    default_dtype,
    fake_building,
    reward_networks,
    scheduler_of,
)
from flowcredit.config import Config
from flowcredit.models.memory_options import modules_on, tensor_bytes

GIB = 2**30
PHASES = ("text_encoding", "rollout", "values", "reward", "update", "evaluation")
PARTS = ("weights", "gradients", "optimizer", "activations", "temporaries")


def estimate(cfg: Config, size: str = "medium", tiny_text: bool = False) -> dict:
    """Predicted peak GPU memory per phase of ``cfg`` on the real-size model (module docstring).

    Returns ``{"phases": {phase: {part: bytes, "peak": bytes}}, "peak": bytes, "peak_phase": str,
    "attention_kernel": str, "attention_correction": bytes, "settings": {...}}``.
    """
    built = build(cfg, size, tiny_text)
    return run_phases(built.cfg, built.model, built.policy, built.reward) | {"settings": settings_of(built)}


def build(cfg: Config, size: str = "medium", tiny_text: bool = False) -> SimpleNamespace:
    """The fake real-size model of ``cfg`` (its base quantised as ``cfg`` says), its policy and the
    reward's networks: ``SimpleNamespace(cfg, size, tiny_text, model, policy, reward)``. Settings that
    only change what runs (batch, decode chunk, checkpointing, placements) can reuse one build."""
    from flowcredit.models.memory_options import check_memory_options, quantize_base

    if cfg.model == "flux" and size == "medium":
        size = "dev"
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16"
    cfg = replace(cfg, dtype=dtype)
    torch_dtype = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    scheduler = scheduler_of(cfg.model) if cfg.model in SIZES else None
    with fake_building(torch_dtype) as fake:
        model = build_fake_model(cfg, size, scheduler, tiny_text)
        check_memory_options(cfg, model)
        if cfg.base_quantization != "none":
            quantize_base(model.net, cfg.base_quantization)
        reward = reward_networks(cfg)
    # the phases run outside the fake mode: the fake weights make every op they touch fake, while the
    # schedule, the step indices and the host's small tensors stay real (step_loss reads them back)
    with fake.building(torch_dtype):
        policy = make_policy(cfg, model)
    return SimpleNamespace(cfg=cfg, size=size, tiny_text=tiny_text, model=model, policy=policy, reward=reward)


def settings_of(built: SimpleNamespace, cfg: Config | None = None) -> dict:
    """What an estimate assumed: ``built``'s model and ``cfg`` (default: the one it was built for)."""
    cfg, model, reward = cfg or built.cfg, built.model, built.reward
    dtype_name = str(reward.dtype).removeprefix("torch.") if reward is not None else ""
    rows = cfg.batch_size * model.guidance_passes
    return dict(
        model=cfg.model,
        size=built.size,
        dtype=cfg.dtype,
        resolution=[model.height, model.width],
        batch_size=cfg.batch_size,
        transformer_rows=rows,
        guidance_scale=model.guidance_scale,
        max_sequence_length=model.max_sequence_length,
        lora_rank=cfg.lora_rank,
        train_params=cfg.train_params,
        gradient_checkpointing=cfg.gradient_checkpointing,
        cfg_uncond_grad=cfg.cfg_uncond_grad,
        beta=cfg.beta,
        text_encoder_size="tiny" if built.tiny_text else "full",
        text_encoders=cfg.text_encoders,
        decode_chunk=cfg.decode_chunk or type(model).decode_chunk,
        base_quantization=cfg.base_quantization,
        reward=cfg.reward,
        reward_network=None if reward is None else f"{reward.name}, {dtype_name}, {reward.placement}",
    )


def make_policy(cfg: Config, model):
    """The trainer's :class:`~flowcredit.run.policy.Policy` (LoRA, trainable set, reference copy)."""
    from flowcredit.run.policy import Policy

    with default_dtype(model.dtype):  # peft's LoRA layers come out in the base dtype, then float32
        return Policy(
            model,
            cfg.train_params,
            cfg.lora_rank,
            cfg.lora_alpha,
            cfg.lora_targets,
            need_reference=cfg.beta > 0,
            seed=cfg.seed,
        )


def phase_weights(cfg: Config, model, reward, everything: int) -> dict[str, int]:
    """Bytes of weights on the GPU in each phase: ``everything`` (the pipeline and any reference copy),
    less the text encoders where ``cfg.text_encoders`` keeps them off it, plus the reward's networks
    where their placement puts them on it (:func:`~.memory_models.reward_networks`)."""
    from flowcredit.models.memory_options import text_encoder_modules

    text = storage_bytes(*text_encoder_modules(model.pipe))
    net = storage_bytes(*reward.modules) if reward is not None else 0
    out = {}
    for phase in PHASES:
        text_away = cfg.text_encoders == "cpu" or (
            cfg.text_encoders == "offload" and phase != "text_encoding"
        )
        net_here = reward is not None and (
            reward.placement == "device" or (reward.placement == "offload" and phase == "reward")
        )
        out[phase] = everything - text * text_away + net * net_here
    return out


def run_phases(cfg: Config, model, policy, reward=None, probe=None) -> dict:
    """Each phase of one iteration on ``model`` (any adapter, fake or real tensors), its ``policy``
    (:func:`make_policy`) and the ``reward``'s networks (:func:`~.memory_models.reward_networks`, or
    None) under :class:`LiveStorages`; see :func:`estimate`. ``probe.before(phase)`` and
    ``probe.after(phase)``, if given, bracket each phase (the GPU check reads CUDA's peak there)."""
    from flowcredit.run.distributed import Dist
    from flowcredit.run.rollout import chunked_velocity, noise_levels
    from flowcredit.run.session import Session, configure_network

    configure_network(replace(cfg, compile=False), model)
    if hasattr(model, "decode_chunk"):
        model.decode_chunk = cfg.decode_chunk or type(model).decode_chunk
    params = policy.parameters()
    s = Session(
        cfg=cfg,
        run_dir=Path("."),
        dist=Dist(),
        model=model,
        policy=policy,
        optimizer=torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay),
        ema=None,
        reward=None,
        sigmas=model.sigmas(cfg.num_steps, cfg.shift),
        trained=noise_levels(cfg, None)[1],
        train_metas=[],
        eval_metas=[],
    )
    modules = [m for m in model.pipe.components.values() if isinstance(m, nn.Module)]
    modules += [policy.frozen_net] if policy.frozen_net is not None else []
    weights = phase_weights(cfg, model, reward, storage_bytes(*modules, model.net))
    modules += reward.modules if reward is not None else []
    for p in params:  # the optimizer's state, as after the first update
        p.grad = torch.zeros_like(p)
    s.optimizer.step()
    optimizer = storage_bytes(list(s.optimizer.state.values()))
    grads = storage_bytes([p.grad for p in params])
    resident = storage_keys(*modules, model.net, list(s.optimizer.state.values()), [p.grad for p in params])
    b, shape = cfg.batch_size, tuple(model.latent_shape)
    n = len(s.sigmas) - 1
    i = int(torch.nonzero(s.trained)[0, 0]) if s.trained.any() else 0
    levels = noise_levels(cfg, None)[0]
    prompts = [PROMPT] * max(1, cfg.prompts_per_iter)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((b, *shape), generator=gen)
    sigma = s.sigmas[i].expand(b)
    group = torch.zeros(b, dtype=torch.long)
    out: dict[str, dict] = {}
    kernels: set[str] = set()
    correction = 0

    def measure(name, fn, grads_live=False):
        nonlocal correction
        counter = LiveStorages(resident)
        if probe is not None:
            probe.before(name)
        with counter:
            saved, square = fn() or ({}, {})
        if probe is not None:
            probe.after(name)
        if saved is None:  # the phase ran off the GPU: ``square`` holds what it left there
            counter.peak, saved, square = square, {}, {}
        kernels.update(counter.kernels)
        act = sum(saved.values())
        if square and not any("attention" in k for k in counter.kernels):  # the math kernel ran
            correction = sum(square.values())  # its N×N probabilities: GPU kernels save O(N) instead
            act -= correction
        part = dict(weights=weights[name], gradients=grads if grads_live else 0, optimizer=optimizer)
        part |= dict(activations=act, temporaries=max(0, counter.peak - act - correction * bool(saved)))
        part["peak"] = sum(part[k] for k in PARTS)
        out[name] = part

    with torch.no_grad():
        cond = model.encode(prompts)  # outside the counter: the encoding is resident as long as the weights

    def text_encoding():
        model._cache = None
        with torch.no_grad():
            model.encode(prompts)
        if cfg.text_encoders == "cpu":  # encoded on the host: only the encoding comes to the GPU
            return None, tensor_bytes(cond)

    def rollout():
        with torch.no_grad(), s.sampling_policy():
            v = chunked_velocity(model, x, sigma, cond, group, b)
            s.step_fn(v, x, sigma, s.sigmas[i + 1].expand(b), float(levels[i]), generator=gen)

    # the values decode all the iteration's rows (prompts_per_iter × group_size), decode_chunk at a time
    finals = torch.randn(
        (min(getattr(model, "decode_chunk", b), cfg.prompts_per_iter * cfg.group_size), *shape)
    )

    def values():
        with torch.no_grad(), policy.merged():
            if s.credit.needs != "final":
                chunked_velocity(model, x, sigma, cond, group, b)
            model.decode(finals)

    def reward_phase():
        with torch.no_grad():
            images = model.decode(finals)
            if reward is not None and reward.placement != "cpu":  # its towers on a batch of 224 px crops
                dev = model.device  # a real GPU run moves an offloaded reward there (fake runs: all "cpu")
                moving = reward.placement == "offload" and dev.type != "cpu"
                with modules_on(reward.modules, dev, "cpu") if moving else contextlib.nullcontext():
                    crop = torch.nn.functional.interpolate(images[:1], size=(224, 224))
                    crops = crop.repeat(reward.batch, 1, 1, 1).to(dev, reward.dtype)  # (batch, 3, 224, 224)
                    reward.clip.vision_model(pixel_values=crops)
                    ids = torch.zeros((reward.batch, 77), dtype=torch.long, device=dev)
                    reward.clip.text_model(input_ids=ids)

    def update():
        from flowcredit.train import step_loss

        states = torch.randn((b, n + 1, *shape), generator=gen)  # the rollout's, on the host
        ro = SimpleNamespace(states=states, logp=torch.zeros(b, n), means=states[:, 1:], uncond=None)
        sam = SimpleNamespace(ro=ro, group=group)
        with saved_for_backward(resident) as (saved, square):
            step_loss(s, SimpleNamespace(sigmas=s.sigmas), levels, sam, torch.ones(b, n), prompts, cond,
                      torch.arange(b), i, 1.0, 1.0)  # fmt: skip
        s.optimizer.step()
        return saved, square

    def evaluation():
        from flowcredit.sde import SAMPLERS

        with torch.no_grad():
            v = chunked_velocity(model, x, s.sigmas[0].expand(b), cond, group, b)
            xn = SAMPLERS["ode"](v, x, s.sigmas[0].expand(b), s.sigmas[1].expand(b)).x_next
            model.decode(xn[: getattr(model, "decode_chunk", b)])

    for name, fn in [("text_encoding", text_encoding), ("rollout", rollout), ("values", values)]:
        measure(name, fn)
    measure("reward", reward_phase)
    measure("update", update, grads_live=True)
    measure("evaluation", evaluation)
    fused = sorted(k for k in kernels if "attention" in k)
    peak_phase = max(out, key=lambda k: out[k]["peak"])
    return dict(
        phases=out,
        peak=out[peak_phase]["peak"],
        peak_phase=peak_phase,
        attention_kernel=", ".join(fused) if fused else "math (softmax of the N×N scores)",
        attention_correction=correction,
        trainable_parameters=sum(p.numel() for p in params),
        transformer_parameters=sum(p.numel() for p in model.net.parameters()),
    )
