"""The built-in tiny text-to-image flow model: adapter, config, checkpoint I/O.

Pixels are the latent space: ``x = 2·img − 1`` and ``decode(x) = clamp((x + 1)/2, 0, 1)``, images
3×32×32. The network (``tiny_net.TinyNet``) holds the text encoder and the U-Net, so a trainer can
select trainable weights by module name (``text.*``, ``unet.*``) or wrap LoRA around its Linear layers.
A checkpoint is a directory with ``model.safetensors`` (weights) and ``config.json`` (``TinyConfig``:
architecture, vocabulary, sampling defaults); no pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flowcredit.errors import ConfigError, reading
from flowcredit.models.protocol import FlowModelBase
from flowcredit.models.run_paths import run_path_problem
from flowcredit.models.tiny_net import TinyNet
from flowcredit.models.tokenizer import Tokenizer

WEIGHTS, CONFIG = "model.safetensors", "config.json"
CHECKPOINT_FIELD = "config field 'checkpoint'"
"""How a load error names where the directory came from (``TinyFlowModel.load``'s ``what``)."""


@dataclass
class TinyConfig:
    """Architecture, vocabulary and sampling defaults of a tiny model (saved as ``config.json``)."""

    vocab: tuple[str, ...]
    """Caption words the tokenizer accepts."""
    max_len: int = 12
    """Token slots per prompt."""
    size: int = 32
    """Image side in pixels."""
    channels: int = 32
    """U-Net base channels."""
    mults: tuple[int, ...] = (1, 2, 2)
    """Channel multiplier per U-Net level (each level after the first halves the resolution)."""
    text_dim: int = 64
    """Word-embedding and text-token width."""
    text_layers: int = 2
    """Transformer layers in the text encoder."""
    pooled_dim: int = 128
    """Width of the pooled text vector that drives FiLM."""
    guidance_scale: float = 2.0
    """Default classifier-free guidance weight."""
    num_steps: int = 10
    """Default number of ODE sampling steps."""
    shift: float = 1.0
    """Default schedule shift (docs/algorithms.md §0)."""
    autocast: bool = False
    """Run the network under bf16 autocast (faster only on CPUs with AMX/AVX512-bf16, and on GPUs)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TinyConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TinyConfig keys {unknown}; known: {sorted(known)}")
        d = dict(d)
        for key in ("vocab", "mults"):
            if key in d:
                d[key] = tuple(d[key])
        return cls(**d)


@dataclass
class TextCond:
    """Encoded prompts: ``tokens (B, L, D)``, ``mask (B, L)`` bool, ``pooled (B, P)``.

    ``null`` is the encoding of the null caption with batch size 1 (the unconditional branch of
    classifier-free guidance); it is ``None`` on the null encoding itself. Rows can be selected
    (``cond[idx]``) and concatenated (``TextCond.cat``); ``null`` is shared.
    """

    tokens: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor
    null: TextCond | None = None

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, idx) -> TextCond:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        return TextCond(self.tokens[idx], self.mask[idx], self.pooled[idx], self.null)

    def expand(self, batch: int) -> TextCond:
        """A batch-1 encoding repeated to ``batch`` rows (views, no copy)."""
        return TextCond(
            self.tokens.expand(batch, -1, -1),
            self.mask.expand(batch, -1),
            self.pooled.expand(batch, -1),
            self.null,
        )

    def detach(self) -> TextCond:
        null = None if self.null is None else self.null.detach()
        return TextCond(self.tokens.detach(), self.mask, self.pooled.detach(), null)

    @staticmethod
    def cat(conds: Sequence[TextCond]) -> TextCond:
        return TextCond(
            torch.cat([c.tokens for c in conds]),
            torch.cat([c.mask for c in conds]),
            torch.cat([c.pooled for c in conds]),
            conds[0].null,
        )


class TinyFlowModel(FlowModelBase):
    """``FlowModel`` adapter for ``TinyNet`` (see ``flowcredit.models.protocol``).

    Args:
        config: architecture, vocabulary and defaults.
        net: existing weights; a freshly initialised network (seeded with ``seed``) if omitted.
        seed: initialisation seed; the global torch RNG is left untouched.
    """

    default_lora_targets = "unet"  # LoRA targets for lora_targets='default': the U-Net's Linear/Conv2d
    compose_lora = True  # lora_forward='auto' composes W + s·B·A: 0.73× the iteration (run/lora_compose.py)

    def __init__(self, config: TinyConfig, net: TinyNet | None = None, seed: int = 0):
        self.config = config
        self.tokenizer = Tokenizer(config.vocab, config.max_len)
        if net is None:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                net = TinyNet(
                    self.tokenizer.size,
                    config.max_len,
                    config.channels,
                    config.mults,
                    config.text_dim,
                    config.text_layers,
                    config.pooled_dim,
                )
        self.net = net
        self.latent_shape: tuple[int, ...] = (3, config.size, config.size)
        self.guidance_scale = float(config.guidance_scale)
        self.num_steps = int(config.num_steps)
        self.shift = float(config.shift)
        self.autocast = bool(config.autocast)

    @property
    def device(self) -> torch.device:
        return next(self.net.parameters()).device

    def to(self, device: str | torch.device) -> TinyFlowModel:
        self.net.to(device)
        return self

    def encode(self, prompts: list[str]) -> TextCond:
        """Encode ``B`` prompts plus the null caption in one text-encoder pass (current grad mode)."""
        ids, mask = self.tokenizer([*prompts, ""])  # (B + 1, L)
        ids, mask = ids.to(self.device), mask.to(self.device)
        tokens, pooled = self.net(ids, mask=mask)  # the text encoder: (B + 1, L, D), (B + 1, P)
        B = len(prompts)
        null = TextCond(tokens[B:], mask[B:], pooled[B:])
        return TextCond(tokens[:B], mask[:B], pooled[:B], null)

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, cond: TextCond) -> torch.Tensor:
        """One unguided network pass (bf16 autocast if ``self.autocast``).

        Args:
            x: ``(B, 3, H, W)``; sigma: ``(B,)``; cond: ``B`` rows (no null branch is added).
        Returns:
            float32 ``(B, 3, H, W)``.
        """
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            v = self.net(x, sigma, cond.tokens, cond.mask, cond.pooled)
        return v.float()

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor | float, cond: TextCond) -> torch.Tensor:
        """Guided velocity ``v_null + w·(v_cond − v_null)``, ``w = self.guidance_scale`` (``v_null``
        detached if ``cfg_uncond_grad`` is off).

        Args:
            x: ``(B, 3, H, W)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``encode`` output.
        Returns:
            ``(B, 3, H, W)`` float32 on ``x``'s device. With ``w == 1`` only the conditional pass runs;
            otherwise both branches run as one batch of ``2B`` (``cfg_uncond_grad`` off: two of ``B``).
            ``x`` may live on another device than the network (the trainer keeps latents on the CPU):
            it is moved there and back.
        """
        if x.device != self.device:
            return self.velocity(x.to(self.device), torch.as_tensor(sigma).to(self.device), cond).to(x.device)
        B = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(B)  # (B,)
        w = self.guidance_scale
        if w == 1.0:
            return self.predict(x, sigma, cond)
        if cond.null is None:
            raise ValueError("guidance_scale != 1 needs a cond from encode() (it carries the null branch)")
        null = cond.null.expand(B)
        v_cond, v_null = self.guided_pair(
            lambda: self.predict(
                torch.cat([x, x]), torch.cat([sigma, sigma]), TextCond.cat([cond, null])
            ).chunk(2),
            lambda: self.predict(x, sigma, cond),
            lambda: self.predict(x, sigma, null),
        )  # one pass of 2B rows (cfg_uncond_grad off: B conditional rows, B unconditional without grad)
        return v_null + w * (v_cond - v_null)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, 3, H, W)`` → images in [0, 1] (``(x + 1) / 2``, clamped)."""
        return ((x.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    @staticmethod
    def to_latent(images: torch.Tensor) -> torch.Tensor:
        """Images ``(B, 3, H, W)`` in [0, 1] → latents ``2·img − 1``."""
        return images.float() * 2.0 - 1.0

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.net.parameters() if p.requires_grad]

    def save_final(self, policy, directory: Path) -> None:
        """The trained model as a checkpoint directory (LoRA merged into the weights), loadable with
        ``flowcredit eval --checkpoint DIR``."""
        merged = type(self)(self.config)
        merged.net.load_state_dict(policy.merged_state_dict())
        merged.guidance_scale = self.guidance_scale
        merged.save(directory)

    def save(self, directory: str | Path) -> None:
        """Write ``model.safetensors`` and ``config.json`` atomically (temp file + ``os.replace``)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        config = dataclasses.replace(
            self.config,
            guidance_scale=self.guidance_scale,
            num_steps=self.num_steps,
            shift=self.shift,
            autocast=self.autocast,
        )
        state = {k: v.detach().cpu().contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, str(d / (WEIGHTS + ".tmp")), metadata={"format": "pt"})
        os.chmod(d / (WEIGHTS + ".tmp"), 0o644)  # safetensors creates 0600; checkpoints are shareable
        (d / (CONFIG + ".tmp")).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        os.replace(d / (WEIGHTS + ".tmp"), d / WEIGHTS)
        os.replace(d / (CONFIG + ".tmp"), d / CONFIG)

    @classmethod
    def load(
        cls, directory: str | Path, device: str | torch.device = "cpu", what: str = CHECKPOINT_FIELD
    ) -> TinyFlowModel:
        """Load a checkpoint directory written by ``save``. A file there that is missing, cut short or
        does not fit is a one-line :class:`~flowcredit.errors.PathError` naming ``what`` (where the
        directory came from) and the file."""
        d = Path(directory)
        with reading(what, directory, CONFIG):
            config = TinyConfig.from_dict(json.loads((d / CONFIG).read_text()))
        model = cls(config)
        with reading(what, directory, WEIGHTS):
            model.net.load_state_dict(load_file(str(d / WEIGHTS)), strict=True)
        return model.to(device)


def builtin_path() -> Path:
    """Directory of the shipped checkpoint (package data ``flowcredit/assets/tiny_shapes``)."""
    return Path(str(resources.files("flowcredit") / "assets" / "tiny_shapes"))


def load_builtin(device: str | torch.device = "cpu") -> TinyFlowModel:
    """The pretrained tiny model shipped with the package (trained on the built-in shapes task)."""
    return TinyFlowModel.load(builtin_path(), device)


def load_checkpoint(spec: str | Path, device: str | torch.device = "cpu") -> TinyFlowModel:
    """``"builtin"`` or a checkpoint directory."""
    return load_builtin(device) if str(spec) == "builtin" else TinyFlowModel.load(spec, device)


def check_checkpoint(spec: str) -> None:
    """Refuse, with a one-line :class:`ConfigError` saying what to give instead, a ``checkpoint`` that
    is not ``"builtin"`` nor a directory holding ``model.safetensors`` and ``config.json``: a missing
    path, a run folder or its training state (:func:`run_path_problem`), a diffusers pipeline."""
    path = Path(spec)
    missing = [name for name in (WEIGHTS, CONFIG) if not (path / name).is_file()]
    if str(spec) == "builtin" or not missing:
        return
    problem = run_path_problem(str(spec))
    if problem:
        raise ConfigError("checkpoint", problem)
    give = f"give 'builtin' or a directory with {WEIGHTS} and {CONFIG} (e.g. a tiny-model run's final/)"
    if not path.is_dir():
        raise ConfigError("checkpoint", f"no such directory {spec!r}; {give}")
    if (path / "model_index.json").is_file():
        give = "it is a diffusers pipeline: give its --model (e.g. sd3, flux)"
    raise ConfigError(
        "checkpoint",
        f"{spec!r} is not a tiny-model checkpoint (it lacks {' and '.join(missing)}); {give}",
    )


def load_for_training(cfg) -> TinyFlowModel:
    """Trainer entry point: the checkpoint named by ``cfg.checkpoint`` (``"builtin"`` or a directory,
    checked by :func:`check_checkpoint`), its network on ``cfg.device``."""
    check_checkpoint(cfg.checkpoint)
    return load_checkpoint(cfg.checkpoint, cfg.device)
