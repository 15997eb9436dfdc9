"""Wan2.1 text-to-video adapter built from ``WanPipeline`` components.

* Latents keep diffusers' layout ``(B, C, F', h, w)`` (C = 16, F' = (F − 1)/4 + 1 latent frames,
  h = H/8): the samplers, values and losses are shape-agnostic (tests/test_video_shapes.py).
  ``decode`` returns clips ``(B, F, 3, H, W)`` in [0, 1], the layout of the pipeline's
  ``output_type="pt"``; an image reward scores them frame by frame (``flowcredit.rewards``).
* ``velocity`` calls the transformer with ``timestep = σ·1000`` (the Euler scheduler's ``t``); its
  output is our ``v ≈ ε − x0``: ``FlowMatchEulerDiscreteScheduler.step`` is ``x + (σ' − σ)·v``.
* CFG is the pipeline's true CFG: a conditional and a negative-prompt branch (``negative_prompt``,
  default ``""`` as the pipeline's), combined in float32 as ``v_neg + w·(v_cond − v_neg)``; the two
  branches run as one batch of ``2B`` (the pipeline runs two calls: equal up to float rounding).
  ``cfg_uncond_grad = False`` detaches ``v_neg``.
* ``sigmas(N)`` is ``scheduler.set_timesteps(N)`` on the checkpoint's scheduler. The hub's Wan2.1
  checkpoints ship ``UniPCMultistepScheduler`` (``use_flow_sigmas``, ``flow_shift`` 3.0): its σ
  schedule is used as is, but our samplers step it with Euler / SDE steps, not UniPC's multistep
  predictor-corrector, and feed the continuous ``σ·1000`` where UniPC rounds timesteps to integers;
  an ODE sample then differs from the pipeline's UniPC output (it equals the output of the same
  pipeline with ``FlowMatchEulerDiscreteScheduler(shift=3.0)``, which the tests check).
* Wan2.2's two-expert pipelines (``transformer_2``, ``boundary_ratio``, ``expand_timesteps``) are
  refused: one transformer is what LoRA wraps and the reference swaps.
"""

from __future__ import annotations

import torch

from flowcredit.errors import ConfigError
from flowcredit.models.diffusers_common import (
    DiffusersFlowModel,
    PromptCond,
    image_size,
    pretrained_options,
    scheduler_sigmas,
)
from flowcredit.models.vae_decode import decode_wan_latents

DEFAULT_SIZE = (480, 832)  # the pipeline's default height × width (Wan2.1 480p)
DEFAULT_FRAMES = 81  # the pipeline's default clip length


class WanFlowModel(DiffusersFlowModel):
    """``FlowModel`` adapter for Wan2.1 text-to-video (see ``flowcredit.models.protocol``).

    Args:
        pipe: a loaded ``WanPipeline`` (only its components and ``encode_prompt`` are used).
        resolution: frame side in pixels (int or ``(H, W)``, multiples of 16); 0/None: 480 × 832.
        guidance_scale: CFG weight; None: 5.0 (the pipeline's default).
        num_frames: clip length F (``4k + 1``); 0/None: 81.
        negative_prompt: the unconditional branch's prompt (the pipeline's default ``""``).
        max_sequence_length: UMT5 tokens, every prompt zero-padded to it; None: 226 (the pipeline's
            ``encode_prompt`` default), clipped to the tokenizer's ``model_max_length``.
    """

    pipeline_name = "WanPipeline"
    decode_chunk = 1  # a clip decode holds every frame's activations
    text_length_default = 226

    def __init__(
        self,
        pipe,
        resolution=None,
        guidance_scale: float | None = None,
        num_frames: int | None = None,
        negative_prompt: str = "",
        max_sequence_length: int | None = None,
    ):
        if getattr(pipe, "transformer_2", None) is not None or pipe.config.get("expand_timesteps", False):
            raise ConfigError(
                "checkpoint",
                "the wan adapter takes Wan2.1 pipelines (one transformer), not Wan2.2's two experts",
            )
        self.spatial = pipe.vae.config.scale_factor_spatial
        self.temporal = pipe.vae.config.scale_factor_temporal
        h, w = image_size(resolution or DEFAULT_SIZE, 0, self.spatial * pipe.transformer.config.patch_size[1])
        super().__init__(pipe, h, w, (0, 0, 0))
        self.set_frames(num_frames or DEFAULT_FRAMES)
        self.guidance_scale = 5.0 if guidance_scale is None else float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.num_steps = 50
        self.shift = float(pipe.scheduler.config.get("shift", pipe.scheduler.config.get("flow_shift", 1.0)))
        self.set_max_sequence_length(max_sequence_length)

    def tokenizer_limit(self) -> int | None:
        """UMT5's tokenizer ``model_max_length``."""
        return getattr(self.pipe.tokenizer, "model_max_length", None)

    def set_frames(self, num_frames: int) -> None:
        """Clip length ``F`` (``4k + 1``): ``latent_shape = (C, (F − 1)/4 + 1, H/8, W/8)``."""
        if num_frames < 1 or (num_frames - 1) % self.temporal:
            raise ConfigError("num_frames", f"{num_frames} must be {self.temporal}·k + 1 (e.g. 33 or 81)")
        self.num_frames = int(num_frames)
        latent_frames = (self.num_frames - 1) // self.temporal + 1
        c = self.net.config.in_channels
        self.latent_shape = (c, latent_frames, self.height // self.spatial, self.width // self.spatial)

    @classmethod
    def from_pretrained(cls, checkpoint: str, num_frames=None, negative_prompt: str = "", **kwargs):
        """:meth:`DiffusersFlowModel.from_pretrained` with the clip length and the negative prompt."""
        model = super().from_pretrained(checkpoint, **kwargs)
        model.set_frames(num_frames or DEFAULT_FRAMES)
        model.negative_prompt = negative_prompt
        return model

    def _encode(self, prompts: list[str]) -> PromptCond:
        """``[*prompts, negative_prompt]`` through the pipeline's ``encode_prompt`` (UMT5, zero-padded to
        ``max_sequence_length``): ``embeds (B, L, 4096)``; the last row is the null branch. Wan has no
        pooled embedding (``pooled`` is ``(B, 0)``)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=[*prompts, self.negative_prompt],
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
            device=self.text_device,
        )
        pooled = embeds.new_zeros(embeds.shape[0], 0)
        b = len(prompts)
        return PromptCond(embeds[:b], pooled[:b], PromptCond(embeds[b:], pooled[b:]))

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """One unguided pass: ``x (B, C, F', h, w)``, ``sigma (B,)`` → float32, on ``x.device``."""
        dev, dtype = self.device, self.dtype
        steps = self.scheduler.config.get("num_train_timesteps", 1000)
        out = self.net(
            hidden_states=x.to(dev, dtype),
            timestep=(sigma.float() * steps).to(dev),
            encoder_hidden_states=embeds.to(dev, dtype),
            return_dict=False,
        )[0]
        return out.float().to(x.device)

    def velocity(self, x: torch.Tensor, sigma, cond: PromptCond) -> torch.Tensor:
        """Guided velocity ``v_neg + w·(v_cond − v_neg)``, ``w = self.guidance_scale`` (``v_neg`` detached
        if ``cfg_uncond_grad`` is off).

        Args:
            x: ``(B, C, F', h, w)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``B`` rows.
        Returns:
            ``(B, C, F', h, w)`` float32. ``w == 1``: one conditional pass; otherwise one pass of ``2B``
            (``cfg_uncond_grad`` off: two of ``B``, :meth:`guided_pair`).
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)  # (B,)
        w = self.guidance_scale
        if w == 1.0:
            return self.predict(x, sigma, cond.embeds)
        null = cond.null.expand(b)
        v_cond, v_neg = self.guided_pair(
            lambda: self.predict(
                torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([cond.embeds, null.embeds])
            ).chunk(2),
            lambda: self.predict(x, sigma, cond.embeds),
            lambda: self.predict(x, sigma, null.embeds),
        )
        return v_neg + w * (v_cond - v_neg)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, F', h, w)`` → clips ``(B, F, 3, H, W)`` float32 in [0, 1],
        ``decode_chunk`` clips at a time."""
        return decode_wan_latents(self.vae, x, self.decode_chunk).permute(0, 2, 1, 3, 4)

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """``(N + 1,)`` float32: ``scheduler.set_timesteps(N)`` as ``WanPipeline`` calls it (the checkpoint's
        shift). ``shift`` is not used: the scheduler's own shift applies."""
        return scheduler_sigmas(self.scheduler, num_steps)


def load_for_training(cfg) -> WanFlowModel:
    """Trainer entry point: ``cfg.checkpoint`` in ``cfg.dtype``, frames ``cfg.resolution``² (0: 480 × 832),
    ``cfg.num_frames`` frames (0: 81); ``cfg.guidance_scale`` 0 keeps 5.0."""
    return WanFlowModel.from_pretrained(
        cfg.checkpoint, num_frames=getattr(cfg, "num_frames", 0) or None, **pretrained_options(cfg)
    )
