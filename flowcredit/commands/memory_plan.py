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
from flowcredit.config import Config
from flowcredit.errors import ConfigError

GIB = 2**30
PHASES = ("text_encoding", "rollout", "values", "reward", "update", "evaluation")
PARTS = ("weights", "gradients", "optimizer", "activations", "temporaries")
PROMPT = "a photo of a red cat next to a big blue square on the sign"

SD35_MEDIUM = {  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    **dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=384),
    **dict(num_layers=24, attention_head_dim=64, num_attention_heads=24, qk_norm="rms_norm"),
    **dict(joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048),
    "dual_attention_layers": tuple(range(13)),
}
SD35_LARGE = {  # stabilityai/stable-diffusion-3.5-large transformer/config.json
    **dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=192),
    **dict(num_layers=38, attention_head_dim=64, num_attention_heads=38, qk_norm="rms_norm"),
    **dict(joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048),
}
SD3_VAE = {  # its vae/config.json
    **dict(latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2),
    **dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4),
    **dict(sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, norm_num_groups=32),
    **dict(use_quant_conv=False, use_post_quant_conv=False),
}
FLUX_DEV = dict(guidance_embeds=True)  # black-forest-labs/FLUX.1-dev: diffusers' defaults otherwise (11.9 B)
FLUX_VAE = SD3_VAE | dict(scaling_factor=0.3611, shift_factor=0.1159)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12)
CLIP_L |= dict(
    num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu"
)
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32)
CLIP_G |= dict(num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
T5_XXL |= dict(feed_forward_proj="gated-gelu", relative_attention_num_buckets=32)
TINY_TEXT = dict(num_hidden_layers=1, intermediate_size=64, num_attention_heads=1)
"""``text_encoders="tiny"``: 1-layer encoders with the real output widths (the 2026-11-29 GPU check's)."""
SIZES = {"sd3": {"medium": SD35_MEDIUM, "large": SD35_LARGE}, "flux": {"dev": FLUX_DEV}}


@contextlib.contextmanager
def fake_building(dtype: torch.dtype):
    """Build modules on fake CPU tensors in ``dtype``; ``Module.to`` is a no-op meanwhile (fake
    parameters cannot be swapped, and the device and dtype are set at construction)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    @contextlib.contextmanager
    def building(dtype):
        saved_to, saved_dtype = nn.Module.to, torch.get_default_dtype()
        nn.Module.to = lambda self, *args, **kwargs: self
        torch.set_default_dtype(dtype)
        try:
            with mode:
                yield
        finally:
            nn.Module.to = saved_to
            torch.set_default_dtype(saved_dtype)

    with building(dtype):
        yield SimpleNamespace(mode=mode, building=building)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def word_tokenizer(max_length: int):
    """A word-level tokenizer that pads to ``max_length`` (token ids, not the real vocabulary: the
    memory depends on the sequence length only)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[EOS]", *PROMPT.split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        eos_token="[EOS]",
        model_max_length=max_length,
    )


def text_encoders(model: str, tiny: bool, dtype: torch.dtype) -> dict:
    """The pipeline's text encoders and tokenizers at real size (or 1-layer, ``tiny``), in ``dtype``."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    shrink = TINY_TEXT if tiny else {}
    t5 = T5_XXL | (dict(num_layers=1, d_ff=64, num_heads=1, vocab_size=64) if tiny else {})
    with default_dtype(dtype):
        clip_l = CLIPTextConfig(**(CLIP_L | shrink), eos_token_id=2, pad_token_id=0)
        t5_model = T5EncoderModel(T5Config(**t5, pad_token_id=0, eos_token_id=2))
        if model == "flux":
            return dict(
                text_encoder=CLIPTextModel(clip_l),
                tokenizer=word_tokenizer(77),
                text_encoder_2=t5_model,
                tokenizer_2=word_tokenizer(512),
            )
        clip_g = CLIPTextConfig(**(CLIP_G | shrink), eos_token_id=2, pad_token_id=0)
        return dict(
            text_encoder=CLIPTextModelWithProjection(clip_l),
            tokenizer=word_tokenizer(77),
            text_encoder_2=CLIPTextModelWithProjection(clip_g),
            tokenizer_2=word_tokenizer(77),
            text_encoder_3=t5_model,
            tokenizer_3=word_tokenizer(512),
        )


def scheduler_of(model: str):
    """The checkpoint's scheduler (built outside the fake mode: its constructor reads numbers back)."""
    import diffusers

    if model == "sd3":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15
    )


def build_fake_model(cfg: Config, size: str, scheduler, tiny_text: bool = False):
    """The SD3 / FLUX.1 adapter over a real-size pipeline of fake tensors (call inside
    :func:`fake_building`): transformer and text encoders in ``cfg.dtype``, VAE in float32."""
    import diffusers

    from flowcredit.models.diffusers_common import pretrained_options, resolve_dtype

    dtype = resolve_dtype(cfg.dtype if cfg.dtype != "auto" else "bfloat16")
    if cfg.model not in SIZES:
        raise ConfigError("model", f"{cfg.model!r}: `flowcredit memory` knows {sorted(SIZES)}")
    if size not in SIZES[cfg.model]:
        raise ConfigError("size", f"{size!r} for {cfg.model}: one of {sorted(SIZES[cfg.model])}")
    with default_dtype(dtype):
        if cfg.model == "sd3":
            net = diffusers.SD3Transformer2DModel(**SIZES["sd3"][size])
        else:
            net = diffusers.FluxTransformer2DModel(**SIZES["flux"][size])
    with default_dtype(torch.float32):
        vae = diffusers.AutoencoderKL(**(SD3_VAE if cfg.model == "sd3" else FLUX_VAE))
    texts = text_encoders(cfg.model, tiny_text, dtype)
    opts = pretrained_options(cfg)
    if cfg.model == "sd3":
        from flowcredit.models.sd3 import SD3FlowModel

        pipe = diffusers.StableDiffusion3Pipeline(transformer=net, scheduler=scheduler, vae=vae, **texts)
        model = SD3FlowModel(pipe, opts["resolution"], opts["guidance_scale"], opts["max_sequence_length"])
    else:
        from flowcredit.models.flux import FluxFlowModel

        pipe = diffusers.FluxPipeline(transformer=net, scheduler=scheduler, vae=vae, **texts)
        model = FluxFlowModel(pipe, opts["resolution"], opts["guidance_scale"], opts["max_sequence_length"])
    pipe.set_progress_bar_config(disable=True)
    return model


def estimate(cfg: Config, size: str = "medium", tiny_text: bool = False) -> dict:
    """Predicted peak GPU memory per phase of ``cfg`` on the real-size model (module docstring).

    Returns ``{"phases": {phase: {part: bytes, "peak": bytes}}, "peak": bytes, "peak_phase": str,
    "attention_kernel": str, "attention_correction": bytes, "settings": {...}}``.
    """
    if cfg.model == "flux" and size == "medium":
        size = "dev"
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16"
    cfg = replace(cfg, dtype=dtype)
    torch_dtype = torch.bfloat16 if dtype in ("bfloat16", "bf16") else torch.float32
    scheduler = scheduler_of(cfg.model) if cfg.model in SIZES else None
    with fake_building(torch_dtype) as fake:
        model = build_fake_model(cfg, size, scheduler, tiny_text)
    # the phases run outside the fake mode: the fake weights make every op they touch fake, while the
    # schedule, the step indices and the host's small tensors stay real (step_loss reads them back)
    with fake.building(torch_dtype):
        policy = make_policy(cfg, model)
    return run_phases(cfg, model, policy) | {"settings": settings_of(cfg, size, tiny_text, model)}


def settings_of(cfg: Config, size: str, tiny_text: bool, model) -> dict:
    rows = cfg.batch_size * model.guidance_passes
    return dict(
        model=cfg.model,
        size=size,
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
        text_encoders="tiny" if tiny_text else "full",
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


def run_phases(cfg: Config, model, policy) -> dict:
    """Each phase of one iteration on ``model`` (any adapter, fake or real tensors) and its
    ``policy`` (:func:`make_policy`) under :class:`LiveStorages`; see :func:`estimate`."""
    from flowcredit.run.distributed import Dist
    from flowcredit.run.rollout import chunked_velocity, noise_levels
    from flowcredit.run.session import Session, configure_network

    configure_network(replace(cfg, compile=False), model)
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
    weights = storage_bytes(*modules, model.net)
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
        with counter:
            saved, square = fn() or ({}, {})
        kernels.update(counter.kernels)
        act = sum(saved.values())
        if square and not any("attention" in k for k in counter.kernels):  # the math kernel ran
            correction = sum(square.values())  # its N×N probabilities: GPU kernels save O(N) instead
            act -= correction
        part = dict(weights=weights, gradients=grads if grads_live else 0, optimizer=optimizer)
        part |= dict(activations=act, temporaries=max(0, counter.peak - act - correction * bool(saved)))
        part["peak"] = sum(part[k] for k in PARTS)
        out[name] = part

    with torch.no_grad():
        cond = model.encode(prompts)  # outside the counter: the encoding is resident as long as the weights

    def text_encoding():
        model._cache = None
        with torch.no_grad():
            model.encode(prompts)

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

    def reward():
        with torch.no_grad():
            model.decode(finals)

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
    measure("reward", reward)
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
