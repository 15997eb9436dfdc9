"""Pieces shared by the diffusers adapters (``sd3.py``, ``flux.py``): dtype and device choice, the
prompt-encoding container, the base adapter (encode cache, VAE decode, schedule, LoRA export).

Numerics: the transformer and text encoders run in the configured dtype (bf16 on GPUs); the VAE is
kept in float32 (as Flow-GRPO does: cheap, and fp16/bf16 VAE decodes lose detail); everything the
samplers see — latents, velocities, images — is float32 (docs/algorithms.md §0).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from flowcredit.errors import ConfigError
from flowcredit.models.diffusers_checkpoint import LORA_WEIGHTS, check_checkpoint
from flowcredit.models.memory_options import (
    EncodingCache,
    modules_on,
    move_tensors,
    quantize_base,
    text_encoder_modules,
)
from flowcredit.models.protocol import FlowModelBase
from flowcredit.models.vae_decode import decode_latents
from flowcredit.schedule import resolution_shift_mu

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
EXPORT_INFO = "flowcredit_export.json"
"""Written beside a diffusers export: the pipeline class and the call keywords that reproduce the policy."""


def resolve_dtype(name: str | torch.dtype | None) -> torch.dtype:
    """``"auto"``/``None`` → bf16 on CUDA, float32 on CPU; else one of ``DTYPES``."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "", "auto"):
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name not in DTYPES:
        raise ConfigError("dtype", f"{name!r} is not one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (one GPU per rank under torchrun / accelerate) if CUDA is available, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def image_size(resolution, default: int, multiple: int) -> tuple[int, int]:
    """``(H, W)`` in pixels from an int, a pair, or 0/None (``default``); each a multiple of ``multiple``."""
    if not resolution:
        resolution = default
    h, w = (resolution, resolution) if isinstance(resolution, int) else tuple(resolution)
    if h % multiple or w % multiple:
        raise ConfigError("resolution", f"{h}×{w} must be a multiple of {multiple}")
    return int(h), int(w)


@dataclass
class PromptCond:
    """Encoded prompts: ``embeds (B, L, D)`` token embeddings, ``pooled (B, P)`` pooled embeddings.

    ``null`` is the empty-prompt encoding with batch size 1 (the unconditional CFG branch; ``None``
    for models without true CFG). ``cond[idx]`` selects rows (``idx``: LongTensor, slice or int);
    ``null`` is shared by every selection.
    """

    embeds: torch.Tensor
    pooled: torch.Tensor
    null: PromptCond | None = None

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def __getitem__(self, idx) -> PromptCond:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        if torch.is_tensor(idx):
            idx = idx.to(self.embeds.device)
        return PromptCond(self.embeds[idx], self.pooled[idx], self.null)

    def rows(self, i: int) -> PromptCond:
        """Row ``i`` alone, without ``null`` (the per-prompt cache keeps ``null`` once)."""
        return PromptCond(self.embeds[i : i + 1], self.pooled[i : i + 1])

    @staticmethod
    def cat_rows(rows: list[PromptCond], null: PromptCond | None) -> PromptCond:
        """Rows of :meth:`rows` joined in order, with ``null``."""
        return PromptCond(torch.cat([r.embeds for r in rows]), torch.cat([r.pooled for r in rows]), null)

    def expand(self, batch: int) -> PromptCond:
        """A batch-1 encoding repeated to ``batch`` rows (views, no copy)."""
        return PromptCond(self.embeds.expand(batch, -1, -1), self.pooled.expand(batch, -1), self.null)


def scheduler_sigmas(scheduler, num_steps: int, sigmas=None, image_seq_len: int = 0) -> torch.Tensor:
    """The ``(N + 1,)`` float32 schedule diffusers' pipeline uses: ``scheduler.set_timesteps`` on a fresh
    copy of ``scheduler`` (its shift, dynamic shifting, terminal stretch…), with FLUX's ``μ`` from
    ``image_seq_len`` when the scheduler shifts dynamically. σ_0 = 1, σ_N = 0."""
    fresh = type(scheduler).from_config(scheduler.config)
    kwargs = {}
    if fresh.config.get("use_dynamic_shifting", False):
        c = fresh.config
        kwargs["mu"] = resolution_shift_mu(
            image_seq_len,
            c.get("base_image_seq_len", 256),
            c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5),
            c.get("max_shift", 1.15),
        )
    if sigmas is not None:
        fresh.set_timesteps(sigmas=sigmas, **kwargs)
    else:
        fresh.set_timesteps(num_steps, **kwargs)
    out = fresh.sigmas.detach().to("cpu", torch.float32).clone()
    if out.numel() != num_steps + 1:
        raise ValueError(f"scheduler gave {out.numel() - 1} steps, asked for {num_steps}")
    if not torch.isfinite(out).all():  # Qwen-Image's terminal stretch divides by zero at N = 1
        raise ValueError(
            f"{type(fresh).__name__} gave a non-finite {num_steps}-step schedule {out.tolist()} (so does the "
            f"diffusers pipeline); shift_terminal={fresh.config.get('shift_terminal')}: use at least 2 steps"
        )
    return out


class DiffusersFlowModel(FlowModelBase):
    """Base of the diffusers adapters; a subclass sets ``pipeline_name`` and implements ``_encode``
    (prompts → ``PromptCond`` rows) and ``velocity``.

    Attributes: ``pipe`` (the pipeline object, used as a container of components and for its
    ``encode_prompt``; its ``__call__`` is never used), ``net`` (the transformer: what LoRA wraps and
    what the trainer swaps for the reference copy), ``vae``, ``scheduler`` (for the schedule only),
    ``latent_shape``, ``guidance_scale``, ``num_steps`` (the pipeline's default step count).
    """

    pipeline_name = ""  # the diffusers pipeline class, e.g. "StableDiffusion3Pipeline"
    default_lora_targets = "to_q,to_k,to_v,to_out.0"  # attention projections (the papers' LoRA targets)
    decode_chunk = 8
    text_length_default = 512  # text tokens by default (clipped to tokenizer_limit()), the pipeline's
    text_length_cap: int | None = None  # the most the pipeline takes (its check_inputs), None: no bound
    max_sequence_length: int

    def __init__(self, pipe, height: int, width: int, latent_shape: tuple[int, int, int]):
        self.pipe, self.net, self.vae, self.scheduler = pipe, pipe.transformer, pipe.vae, pipe.scheduler
        self.pipeline_class = type(pipe)  # its save_lora_weights writes the LoRA file
        self.height, self.width = height, width
        self.latent_shape = latent_shape
        self.num_steps = 28
        self._cache: tuple[tuple[str, ...], PromptCond] | None = None
        self.text_placement, self._host_cache = "device", None  # memory_options.TEXT_PLACEMENTS
        for module in pipe.components.values():
            if isinstance(module, torch.nn.Module):
                module.requires_grad_(False).eval()
        if self.vae.dtype != torch.float32:
            self.vae.to(torch.float32)

    @classmethod
    def from_pretrained(
        cls,
        checkpoint: str,
        dtype="auto",
        device=None,
        resolution=None,
        guidance_scale=None,
        max_sequence_length=None,
        text_encoders="device",
        base_quantization="none",
        **load_kwargs,
    ):
        """Load a hub id or a local pipeline directory: weights in ``dtype`` (VAE in float32), on
        ``device`` (CUDA if available), text encoded with ``max_sequence_length`` tokens (None: the
        adapter's default), the text encoders placed and the base quantised before anything moves
        to the device (:mod:`~flowcredit.models.memory_options`); ``load_kwargs`` go to the pipeline's
        ``from_pretrained`` (``revision``, ``variant``, ``local_files_only``…)."""
        import diffusers

        check_checkpoint(str(checkpoint), cls.pipeline_name)
        pipeline_class = getattr(diffusers, cls.pipeline_name)
        dtypes = {"default": resolve_dtype(dtype), "vae": torch.float32}
        try:
            pipe = pipeline_class.from_pretrained(checkpoint, dtype=dtypes, **load_kwargs)
        except (OSError, ValueError) as exc:  # offline hub id, missing files, wrong components
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                "checkpoint", f"cannot load {checkpoint!r} as a {cls.pipeline_name}: {first}"
            ) from exc
        pipe.set_progress_bar_config(disable=True)
        model = cls(pipe, resolution, guidance_scale)
        model.set_max_sequence_length(max_sequence_length)
        if text_encoders != "device":
            model.set_text_placement(text_encoders)
        if base_quantization != "none":
            quantize_base(model.net, base_quantization)
        return model.to(device or default_device())

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype: that of its first weight outside the modules the model
        keeps in float32 on purpose (``_keep_in_fp32_modules``: Wan's norms and time embedder) and
        outside LoRA (whose weights we keep in float32)."""
        keep = getattr(self.net, "_keep_in_fp32_modules", None) or []
        for name, p in self.net.named_parameters():
            if p.is_floating_point() and "lora_" not in name and not any(k in name for k in keep):
                return p.dtype
        return next(self.net.parameters()).dtype

    def to(self, device: str | torch.device) -> DiffusersFlowModel:
        """Every component on ``device``, but text encoders placed off it (``set_text_placement``)."""
        if self.text_placement == "device":
            self.pipe.to(device)
        else:
            away = {id(m) for m in text_encoder_modules(self.pipe)}
            for module in self.pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    module.to("cpu" if id(module) in away else device)
        self.net.to(device)
        self._cache = None
        return self

    def set_text_placement(self, placement: str) -> None:
        """Where the text encoders live (:data:`~flowcredit.models.memory_options.TEXT_PLACEMENTS`):
        ``"device"`` beside the transformer; ``"offload"``: on the host, on the device while encoding;
        ``"cpu"``: encode on the host. Off the device, encodings are cached per prompt on the host."""
        self.text_placement = placement
        self._host_cache = EncodingCache() if placement != "device" else None
        self.to(self.device)

    @property
    def text_device(self) -> torch.device:
        """Where the text encoders run: the host for ``"cpu"``, the transformer's device otherwise."""
        return torch.device("cpu") if self.text_placement == "cpu" else self.device

    def tokenizer_limit(self) -> int | None:
        """The ``model_max_length`` of the tokenizer whose length ``max_sequence_length`` sets (None:
        not bounded by it); only the default length is clipped to it."""
        return None

    def default_max_sequence_length(self) -> int:
        """The text tokens this adapter encodes with when the config leaves ``max_sequence_length`` at 0."""
        limit = self.tokenizer_limit()
        return self.text_length_default if limit is None else min(self.text_length_default, int(limit))

    def set_max_sequence_length(self, n: int | None) -> None:
        """Encode prompts (and the negative prompt) with ``n`` text tokens from now on (None or 0: the
        default); above the pipeline's bound: ``ConfigError``."""
        bound = self.text_length_cap
        if not n:
            n = self.default_max_sequence_length()
        elif n < 1 or (bound is not None and n > bound):
            most = "a positive count" if bound is None else f"at most {bound}"
            raise ConfigError("max_sequence_length", f"{n} tokens, but {self.pipeline_name} takes {most}")
        self.max_sequence_length = int(n)
        self._cache = None

    def encode(self, prompts: list[str]) -> PromptCond:
        """Encode ``B`` prompts once (frozen text encoders, no grad); a repeated call with the same list
        (the trainer re-encodes per update step) returns the cached encoding."""
        key = tuple(prompts)
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                if self._host_cache is None:
                    self._cache = (key, self._encode(list(prompts)))
                else:
                    host = self._host_cache.encode(list(prompts), self._encode_to_host)
                    self._cache = (key, move_tensors(host, self.device))
        return self._cache[1]

    def _encode_to_host(self, prompts: list[str]):
        """``_encode`` with the encoders on ``text_device`` (moved there and back for ``"offload"``),
        the encoding on the host."""
        modules = text_encoder_modules(self.pipe)
        moving = self.text_placement == "offload"
        with modules_on(modules, self.device, "cpu") if moving else contextlib.nullcontext():
            return move_tensors(self._encode(prompts), "cpu")

    def _encode(self, prompts: list[str]) -> PromptCond:
        raise NotImplementedError

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, h, w)`` (our unpacked layout) → images ``(B, 3, H, W)`` float32 in [0, 1]."""
        return decode_latents(self.vae, x, self.decode_chunk)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def save_final(self, policy, directory: str | Path) -> None:
        """Export the trained weights for plain diffusers.

        LoRA: ``directory/pytorch_lora_weights.safetensors`` through the pipeline class's
        ``save_lora_weights`` (with the LoRA config as metadata, so α/r survive the reload); load with
        ``pipe.load_lora_weights(directory, weight_name="pytorch_lora_weights.safetensors")``.
        Full fine-tuning: ``directory/transformer`` via ``save_pretrained``.
        """
        directory = Path(directory)
        if getattr(policy, "lora_names", None):
            save_lora(self.pipeline_class, self.net, directory)
        else:
            self.net.save_pretrained(str(directory / "transformer"))
        how = {"pipeline": self.pipeline_name, **self.pipeline_call_kwargs()}
        (directory / EXPORT_INFO).write_text(json.dumps(how, indent=1) + "\n")

    def pipeline_call_kwargs(self) -> dict:
        """Keywords a plain ``pipe(prompt, …)`` needs to see the policy's text context: the text length
        it encoded with (``max_sequence_length``; the pipelines' own defaults may differ, e.g. Wan's
        ``__call__`` pads to 512 where its adapter, as its ``encode_prompt``, pads to 226)."""
        return {"max_sequence_length": self.max_sequence_length}

    def load_trained(self, final: str | Path) -> None:
        """Apply a run's ``final/`` export to this (base) model in place: its LoRA through the
        pipeline's ``load_lora_weights``, or its fine-tuned ``transformer/``."""
        final = Path(final)
        if (final / LORA_WEIGHTS).is_file():
            self.pipe.load_lora_weights(str(final), weight_name=LORA_WEIGHTS)
        elif (final / "transformer").is_dir():
            trained = type(self.net).from_pretrained(str(final / "transformer"), dtype=self.dtype)
            self.net.load_state_dict(trained.state_dict())
        else:
            raise ConfigError("checkpoint", f"{str(final)!r} holds neither {LORA_WEIGHTS} nor transformer/")
        self._cache = None


def save_lora(pipeline_class, net: torch.nn.Module, directory: Path, adapter: str = "default") -> Path:
    """Write the peft LoRA of ``net`` in diffusers' format; returns the weights file."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(net, adapter_name=adapter)
    metadata = None
    if hasattr(net, "peft_config") and adapter in net.peft_config:
        metadata = net.peft_config[adapter].to_dict()
    directory.mkdir(parents=True, exist_ok=True)
    pipeline_class.save_lora_weights(
        str(directory),
        transformer_lora_layers={k: v.detach().cpu().contiguous() for k, v in state.items()},
        transformer_lora_adapter_metadata=metadata,
        weight_name=LORA_WEIGHTS,
    )
    return directory / LORA_WEIGHTS


def pretrained_options(cfg) -> dict:
    """The Config fields every diffusers loader reads: ``dtype`` as given; ``resolution`` and
    ``guidance_scale`` and ``max_sequence_length`` 0 are the config's documented "model default" (None
    here)."""
    return {
        "dtype": cfg.dtype,
        "resolution": cfg.resolution if cfg.resolution > 0 else None,
        "guidance_scale": cfg.guidance_scale if cfg.guidance_scale > 0 else None,
        "max_sequence_length": getattr(cfg, "max_sequence_length", 0) or None,
        "text_encoders": getattr(cfg, "text_encoders", "device"),
        "base_quantization": getattr(cfg, "base_quantization", "none"),
    }
