"""The model adapter contract: every member the sampler, the trainer and the evaluator use.

Every model, the built-in tiny one and the diffusers adapters alike, implements :class:`FlowModel`.
Conventions (docs/algorithms.md §0): rectified flow ``x_σ = (1 − σ)·x0 + σ·ε``, σ = 1 is
noise, the model returns the velocity ``v ≈ ε − x0``; latents and velocities are float32 whatever the
network's dtype. An adapter subclasses :class:`FlowModelBase`, which defaults the optional members,
and implements the required ones; ``flowcredit.models.load_model`` checks every member at load time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from flowcredit.errors import ConfigError
from flowcredit.schedule import sigmas as default_sigmas

Cond = Any
"""Whatever ``encode`` returns; opaque to the sampler, indexed by rows (``cond[rows]``) and passed
back to ``velocity`` unchanged."""


@runtime_checkable
class FlowModel(Protocol):
    """A text-conditioned flow-matching model, as the loop sees it.

    Required (no default): ``latent_shape``, ``guidance_scale``, ``net``, ``encode``, ``velocity``,
    ``decode``. Optional (defaulted by :class:`FlowModelBase`): ``num_steps``, ``shift``, ``sigmas``,
    ``guidance_passes``, ``default_lora_targets``, ``save_final``, ``fsdp_block_classes``,
    ``enable_gradient_checkpointing``.

    Attributes:
        latent_shape: ``(C, H, W)`` of one latent (a video model's: ``(C, F, H, W)``; the samplers, values
            and losses are shape-agnostic).
        guidance_scale: classifier-free guidance weight ``w`` used inside ``velocity``; 1.0 means a
            single conditional pass.
        net: the ``torch.nn.Module`` holding ALL weights (text encoder included), so a trainer can
            wrap LoRA around sub-modules or pick trainable parameters by module name.
        num_steps: the model's default number of sampling steps (``flowcredit eval`` / ``sample``).
        shift: the default schedule shift used by :meth:`sigmas` when the adapter has no schedule of
            its own.
        default_lora_targets: what ``lora_targets='default'`` wraps (a comma list of module-name
            suffixes, or ``'unet'`` for the tiny model); None: the adapter has no default.
        fsdp_block_classes: class names of the network's repeated blocks, each of which FSDP shards
            as one unit (accelerate's ``transformer_cls_names_to_wrap``).
    """

    latent_shape: tuple[int, ...]
    guidance_scale: float
    net: torch.nn.Module
    num_steps: int
    shift: float
    default_lora_targets: str | None
    fsdp_block_classes: tuple[str, ...]

    def encode(self, prompts: list[str]) -> Cond:
        """Encode ``B`` prompts (and the null prompt for CFG) under the current grad mode."""
        ...

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Cond) -> torch.Tensor:
        """Velocity with CFG: ``v_null + w·(v_cond − v_null)`` (one batched pass of both branches).

        Args:
            x: ``(B, C, H, W)`` float32 latents at noise level ``sigma``.
            sigma: ``(B,)`` float32 noise levels in [0, 1], one per sample.
            cond: ``encode`` output for the same ``B`` rows.
        Returns:
            ``(B, C, H, W)`` float32.
        """
        ...

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, *latent_shape)`` to images ``(B, 3, H', W')`` float32 in [0, 1]; a video model's
        ``(B, C, F, H, W)`` to clips ``(B, F', 3, H', W')`` (rewards score them per frame or whole)."""
        ...

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """The ``(N + 1,)`` float32 schedule ``1 … 0`` the model samples with."""
        ...

    @property
    def guidance_passes(self) -> int:
        """Network passes per sample per ``velocity`` call (2 with CFG; 1 without, or with a
        distilled guidance embedding). Used to count NFE."""
        ...

    def save_final(self, policy: Any, directory: Path) -> None:
        """Export the trained model into ``directory`` in the model's own format (beside the
        ``trainable.safetensors`` the trainer always writes)."""
        ...

    def enable_gradient_checkpointing(self) -> None:
        """Recompute the network's block activations in the backward pass (config field
        ``gradient_checkpointing``); raise ``ConfigError`` if the network cannot."""
        ...


class FlowModelBase:
    """Defaults for the optional members of :class:`FlowModel`; adapters subclass it."""

    num_steps: int = 10
    shift: float = 1.0
    default_lora_targets: str | None = None
    cfg_uncond_grad: bool = True
    """Whether gradients flow through CFG's unconditional branch (config field ``cfg_uncond_grad``);
    an adapter honours it by passing that branch's velocity through :meth:`uncond_branch`."""

    uncond_record: list | None = None
    """While a list (the rollout with ``cfg_uncond_grad`` off): every guided call without gradient
    appends its unconditional velocity here (:meth:`guided_pair`)."""
    uncond_given: torch.Tensor | None = None
    """While set (the update, ``cfg_uncond_grad`` off, weights still the rollout's): the unconditional
    velocity of the call's rows, used instead of running its pass (:meth:`guided_pair`)."""

    def guided_pair(self, joint, cond_only, uncond_only) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v_cond, v_uncond)``, CFG's two branches.

        Without gradient (the rollout, values, evaluation), or with ``cfg_uncond_grad`` on (the
        default): ``joint()``, one pass of ``2B`` rows, its unconditional half through
        :meth:`uncond_branch` (and appended to :attr:`uncond_record` while that is a list). With
        gradient and ``cfg_uncond_grad`` off (Flow-GRPO's ``compute_log_prob``), the unconditional
        branch is a constant of the gradient: it is :attr:`uncond_given` when the trainer hands it
        over (the rollout's own, while the weights are still the rollout's), else a pass of ``B``
        rows without a graph (``uncond_only()``), and the conditional branch is a pass of its own
        (``cond_only()``). The backward then covers ``B`` rows instead of ``2B`` rows half of which
        carry zero gradient: the same gradient for less work (docs/benchmarks.md, the peer
        comparison); the velocity equals the joint pass's to float round-off.
        """
        if self.cfg_uncond_grad or not torch.is_grad_enabled():
            v_cond, v_uncond = joint()
            if self.uncond_record is not None and not torch.is_grad_enabled():
                self.uncond_record.append(v_uncond)
            return v_cond, self.uncond_branch(v_uncond)
        if self.uncond_given is not None:
            v_cond = cond_only()
            return v_cond, self.uncond_given.to(v_cond.device, v_cond.dtype)
        with torch.no_grad():
            v_uncond = uncond_only()
        return cond_only(), v_uncond

    def uncond_branch(self, v_uncond: torch.Tensor) -> torch.Tensor:
        """The unconditional (null / negative-prompt) velocity as the CFG combination takes it:
        detached when ``cfg_uncond_grad`` is off (Flow-GRPO's ``compute_log_prob``), so the update's
        gradient reaches the weights through the conditional branch only. No effect without grad."""
        return v_uncond if self.cfg_uncond_grad else v_uncond.detach()

    def sigmas(self, num_steps: int, shift: float) -> torch.Tensor:
        """``flowcredit.schedule.sigmas(num_steps, shift)``; adapters with a scheduler override it."""
        return default_sigmas(num_steps, shift)

    @property
    def guidance_passes(self) -> int:
        """1 if ``guidance_scale == 1`` (no CFG), else 2 (conditional and unconditional rows)."""
        return 1 if self.guidance_scale == 1.0 else 2

    def save_final(self, policy: Any, directory: Path) -> None:
        """No model-specific export: the trainable tensors alone are the result."""

    @property
    def fsdp_block_classes(self) -> tuple[str, ...]:
        """The network's ``_no_split_modules`` (diffusers and transformers models declare their
        transformer blocks there), else none: FSDP then shards the network as one unit."""
        return tuple(getattr(self.net, "_no_split_modules", None) or ())

    def enable_gradient_checkpointing(self) -> None:
        """Diffusers networks that support it (``_supports_gradient_checkpointing``) turn it on;
        any other network raises ``ConfigError``."""
        if not getattr(self.net, "_supports_gradient_checkpointing", False):
            raise ConfigError(
                "gradient_checkpointing",
                f"the {type(self).__name__} adapter's network ({type(self.net).__name__}) has no "
                "gradient checkpointing (the diffusers adapters have it)",
            )
        self.net.enable_gradient_checkpointing()


@contextmanager
def guidance_at(model: FlowModel, scale: float | None) -> Iterator[None]:
    """``model.guidance_scale`` set to ``scale`` inside the block and restored after (``None``: left as
    it is; 0 is a weight, Z-Image's "no CFG"); ``model.guidance_passes`` inside counts its calls."""
    saved = model.guidance_scale
    if scale is not None:
        model.guidance_scale = float(scale)
    try:
        yield
    finally:
        model.guidance_scale = saved


REQUIRED = ("latent_shape", "guidance_scale", "net", "encode", "velocity", "decode")
OPTIONAL = (
    "num_steps",
    "shift",
    "default_lora_targets",
    "sigmas",
    "guidance_passes",
    "save_final",
    "fsdp_block_classes",
    "enable_gradient_checkpointing",
)


def check_adapter(model: object, name: str) -> None:
    """Raise ``TypeError`` naming every member of :class:`FlowModel` that ``model`` lacks."""
    missing = [m for m in (*REQUIRED, *OPTIONAL) if not hasattr(model, m)]
    if missing:
        hint = (
            " (subclass flowcredit.models.FlowModelBase for the optional ones)"
            if set(missing) & set(OPTIONAL)
            else ""
        )
        raise TypeError(f"model adapter {name!r} lacks {', '.join(missing)}{hint}")
