"""Stable Diffusion 3 / 3.5 adapter built from ``StableDiffusion3Pipeline`` components.

* Latents keep diffusers' layout ``(B, 16, H/8, W/8)``, scaled as the pipeline's latents are
  (``z·scaling_factor`` after subtracting ``shift_factor``); ``decode`` un-scales and runs the VAE.
* ``velocity`` calls the transformer with ``timestep = σ·1000`` (as the pipeline does); its output
  is our ``v ≈ ε − x0`` without a sign change: ``FlowMatchEulerDiscreteScheduler.step`` computes
  ``x + (σ' − σ)·model_output``, exactly our Euler step.
* Classifier-free guidance: the conditional and empty-prompt branches run as one batch of ``2B`` and
  combine in float32, ``v_null + w·(v_cond − v_null)``; ``w == 1`` runs only the conditional branch.
  ``cfg_uncond_grad = False`` detaches ``v_null`` (Flow-GRPO's update): it then runs as its own pass of
  ``B`` rows without a graph (:meth:`FlowModelBase.guided_pair`).
* Text: the CLIP-L and CLIP-G embeddings (77 tokens, their tokenizers' length) are followed by
  ``max_sequence_length`` T5 tokens, padded to that length for every prompt and the empty one alike
  (256 by default, as the pipeline's; Flow-GRPO encodes 128). SD3's joint attention attends to the
  padding tokens too, so the length changes the velocity even for short prompts.
* ``sigmas(N)`` is the scheduler's own schedule for the checkpoint (SD3.5: shift 3.0, ending at a
  small σ before the appended 0), not ``flowcredit.schedule.sigmas``.
"""

from __future__ import annotations

import torch

from flowcredit.models.diffusers_common import (
    DiffusersFlowModel,
    PromptCond,
    image_size,
    pretrained_options,
    scheduler_sigmas,
)


class SD3FlowModel(DiffusersFlowModel):
    """``FlowModel`` adapter for SD3 / SD3.5 (see ``flowcredit.models.protocol``).

    Args:
        pipe: a loaded ``StableDiffusion3Pipeline`` (only its components and ``encode_prompt`` are used).
        resolution: image side in pixels (int or ``(H, W)``); 0/None: the transformer's sample size
            times the VAE factor (1024 for SD3.5-M).
        guidance_scale: CFG weight; None: 4.5 (the papers' SD3.5 setting).
        max_sequence_length: T5 tokens, at most 512 (the pipeline's bound); None: 256, the pipeline's
            default, clipped to the tokenizer's ``model_max_length``.
    """

    pipeline_name = "StableDiffusion3Pipeline"
    text_length_default = 256
    text_length_cap = 512

    def __init__(
        self,
        pipe,
        resolution=None,
        guidance_scale: float | None = None,
        max_sequence_length: int | None = None,
    ):
        t = pipe.transformer.config
        factor = 2 ** (len(pipe.vae.config.block_out_channels) - 1)
        h, w = image_size(resolution, t.sample_size * factor, factor * t.patch_size)
        super().__init__(pipe, h, w, (t.in_channels, h // factor, w // factor))
        self.guidance_scale = 4.5 if guidance_scale is None else float(guidance_scale)
        self.set_max_sequence_length(max_sequence_length)
        self.shift = float(pipe.scheduler.config.get("shift", 1.0))

    def tokenizer_limit(self) -> int | None:
        """T5's tokenizer ``model_max_length`` (None without T5: the pipeline then pads zeros)."""
        tok = self.pipe.tokenizer_3
        return None if tok is None else getattr(tok, "model_max_length", None)

    def _encode(self, prompts: list[str]) -> PromptCond:
        """``[*prompts, ""]`` through the pipeline's ``encode_prompt`` (CLIP-L, CLIP-G, T5) in one call:
        ``embeds (B, 77 + T5 tokens, 4096)``, ``pooled (B, 2048)`` for SD3.5; the last row is the null."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[*prompts, ""],
            prompt_2=None,
            prompt_3=None,
            device=self.text_device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        b = len(prompts)
        null = PromptCond(embeds[b:], pooled[b:])
        return PromptCond(embeds[:b], pooled[:b], null)

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor):
        """One unguided transformer pass: ``x (B, C, h, w)``, ``sigma (B,)`` → float32 ``(B, C, h, w)``
        on ``x.device``."""
        dev, dtype = self.device, self.dtype
        out = self.net(
            hidden_states=x.to(dev, dtype),
            timestep=(sigma.float() * 1000.0).to(dev),
            encoder_hidden_states=embeds.to(dev, dtype),
            pooled_projections=pooled.to(dev, dtype),
            return_dict=False,
        )[0]
        return out.float().to(x.device)

    def velocity(self, x: torch.Tensor, sigma, cond: PromptCond) -> torch.Tensor:
        """Guided velocity ``v_null + w·(v_cond − v_null)``, ``w = self.guidance_scale`` (``v_null``
        detached if ``cfg_uncond_grad`` is off).

        Args:
            x: ``(B, C, h, w)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``B`` rows of
                ``encode`` output.
        Returns:
            ``(B, C, h, w)`` float32. ``w == 1``: one conditional pass; otherwise one pass of ``2B``
            (``cfg_uncond_grad`` off: two of ``B``, :meth:`guided_pair`).
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)  # (B,)
        w = self.guidance_scale
        if w == 1.0:
            return self.predict(x, sigma, cond.embeds, cond.pooled)
        if cond.null is None:
            raise ValueError("guidance_scale != 1 needs a cond from encode() (it carries the null branch)")
        null = cond.null.expand(b)
        v_cond, v_null = self.guided_pair(
            lambda: self.predict(
                torch.cat([x, x]),
                torch.cat([sigma, sigma]),
                torch.cat([null.embeds, cond.embeds]),
                torch.cat([null.pooled, cond.pooled]),
            ).chunk(2)[::-1],  # the batch is (null, cond)
            lambda: self.predict(x, sigma, cond.embeds, cond.pooled),
            lambda: self.predict(x, sigma, null.embeds, null.pooled),
        )
        return v_null + w * (v_cond - v_null)

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """``(N + 1,)`` float32: ``FlowMatchEulerDiscreteScheduler.set_timesteps(N)`` as the SD3 pipeline
        calls it (the checkpoint's shift; resolution-dependent μ if the scheduler shifts dynamically).
        ``shift`` is not used: the scheduler's own shift applies."""
        p = self.net.config.patch_size
        seq_len = (self.latent_shape[1] // p) * (self.latent_shape[2] // p)
        return scheduler_sigmas(self.scheduler, num_steps, image_seq_len=seq_len)


def load_for_training(cfg) -> SD3FlowModel:
    """Trainer entry point: ``cfg.checkpoint`` (hub id or directory) in ``cfg.dtype`` at ``cfg.resolution``;
    ``cfg.guidance_scale`` 0 keeps 4.5."""
    return SD3FlowModel.from_pretrained(cfg.checkpoint, **pretrained_options(cfg))
