"""FLUX.1 adapter built from ``FluxPipeline`` components.

* Our samplers see latents in the unpacked layout ``(B, C, h, w)`` (C = 16 for FLUX.1, h = H/8);
  ``velocity`` packs them into FLUX's 2×2 patch tokens ``(B, h·w/4, 4C)`` for the transformer and
  unpacks its output, with the same index layout as ``FluxPipeline._pack_latents`` (tested).
* The transformer multiplies ``timestep`` and ``guidance`` by 1000 itself, so it gets ``σ`` (the
  pipeline passes ``t / 1000``). Its output is our ``v ≈ ε − x0`` (the scheduler's Euler step is
  ``x + (σ' − σ)·model_output``, as ours).
* Guidance: FLUX.1-dev is guidance-distilled, so ``guidance_scale`` is fed to the guidance embedding
  (one pass per row, no true CFG, no null branch); checkpoints without ``guidance_embeds``
  (FLUX.1-schnell) ignore it.
* ``sigmas(N)``: the pipeline's ``linspace(1, 1/N, N)`` through the scheduler's resolution-dependent
  shift ``μ`` (``use_dynamic_shifting``), then 0.
"""

from __future__ import annotations

import numpy as np
import torch

from flowcredit.models.diffusers_common import (
    DiffusersFlowModel,
    PromptCond,
    image_size,
    pretrained_options,
    scheduler_sigmas,
)


def pack(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` → ``(B, (h/2)·(w/2), 4C)`` 2×2 patch tokens (FLUX's layout)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(B, (h/2)·(w/2), 4C)`` → ``(B, C, h, w)``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int) -> torch.Tensor:
    """RoPE positions of the packed tokens: ``(h/2·w/2, 3)`` rows ``(0, row, col)``."""
    rows = torch.arange(h // 2).repeat_interleave(w // 2)
    cols = torch.arange(w // 2).repeat(h // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float()


class FluxFlowModel(DiffusersFlowModel):
    """``FlowModel`` adapter for FLUX.1 (see ``flowcredit.models.protocol``).

    Args:
        pipe: a loaded ``FluxPipeline`` (only its components and ``encode_prompt`` are used).
        resolution: image side in pixels (int or ``(H, W)``, multiples of 16); 0/None: 1024 (the
            pipeline's default ``128 × vae factor``).
        guidance_scale: distilled-guidance value; None: 3.5 (the FLUX.1-dev pipeline default).
        max_sequence_length: T5 tokens (padded to it; at most 512, the pipeline's bound); None: 512,
            clipped to the tokenizer's ``model_max_length``. The CLIP encoder gives the pooled
            embedding only.
    """

    pipeline_name = "FluxPipeline"
    text_length_default = 512
    text_length_cap = 512

    def __init__(
        self,
        pipe,
        resolution=None,
        guidance_scale: float | None = None,
        max_sequence_length: int | None = None,
    ):
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        h, w = image_size(resolution, 128 * factor, 2 * factor)
        channels = pipe.transformer.config.in_channels // 4
        super().__init__(pipe, h, w, (channels, h // factor, w // factor))
        self.guidance_scale = 3.5 if guidance_scale is None else float(guidance_scale)
        self.set_max_sequence_length(max_sequence_length)
        self._img_ids = image_ids(*self.latent_shape[1:])

    def tokenizer_limit(self) -> int | None:
        """T5's tokenizer ``model_max_length``."""
        return getattr(self.pipe.tokenizer_2, "model_max_length", None)

    def _encode(self, prompts: list[str]) -> PromptCond:
        """The pipeline's ``encode_prompt``: T5 ``embeds (B, L, 4096)``, CLIP ``pooled (B, 768)``; no null."""
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.text_device,
            max_sequence_length=self.max_sequence_length,
        )
        return PromptCond(embeds, pooled)

    def velocity(self, x: torch.Tensor, sigma, cond: PromptCond) -> torch.Tensor:
        """One transformer pass per row with distilled guidance ``self.guidance_scale``.

        Args:
            x: ``(B, C, h, w)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``B`` rows.
        Returns:
            ``(B, C, h, w)`` float32 on ``x.device``.
        """
        b, _, h, w = x.shape
        dev, dtype = self.device, self.dtype
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=dev).expand(b)  # (B,)
        guidance = None
        if self.net.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance_scale, dtype=torch.float32, device=dev)
        out = self.net(
            hidden_states=pack(x.to(dev, dtype)),
            timestep=(sigma * 1000.0).to(dtype) / 1000.0,  # the pipeline's rounding of t / 1000
            guidance=guidance,
            pooled_projections=cond.pooled.to(dev, dtype),
            encoder_hidden_states=cond.embeds.to(dev, dtype),
            txt_ids=torch.zeros(cond.embeds.shape[1], 3, device=dev, dtype=dtype),
            img_ids=self._img_ids.to(dev, dtype),
            return_dict=False,
        )[0]
        return unpack(out, h, w).float().to(x.device)

    guidance_passes = 1
    """Transformer rows per velocity row (distilled guidance: one pass)."""

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """``(N + 1,)`` float32, as ``FluxPipeline`` computes it: ``set_timesteps(sigmas=linspace(1, 1/N,
        N), mu=μ(h·w/4 tokens))`` (``use_flow_sigmas`` schedulers get no custom sigmas). ``shift`` is not
        used: the scheduler's own shift applies."""
        custom = np.linspace(1.0, 1.0 / num_steps, num_steps)
        if self.scheduler.config.get("use_flow_sigmas", False):
            custom = None
        seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
        return scheduler_sigmas(self.scheduler, num_steps, sigmas=custom, image_seq_len=seq_len)


def load_for_training(cfg) -> FluxFlowModel:
    """Trainer entry point: ``cfg.checkpoint`` (hub id or directory) in ``cfg.dtype`` at ``cfg.resolution``;
    ``cfg.guidance_scale`` 0 keeps 3.5."""
    return FluxFlowModel.from_pretrained(cfg.checkpoint, **pretrained_options(cfg))
