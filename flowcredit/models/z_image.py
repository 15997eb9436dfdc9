"""Z-Image adapter built from ``ZImagePipeline`` components.

* Latents keep diffusers' layout ``(B, 16, H/8, W/8)``, scaled like SD3's (``decode`` un-scales
  ``z = x / scaling_factor + shift_factor`` and runs the ``AutoencoderKL``).
* The transformer takes lists: one ``(C, 1, h, w)`` latent and one unpadded ``(L_i, D)`` text
  embedding per row; its time input is ``1 − σ`` (the pipeline's ``(1000 − t)/1000``) and its output
  is the *negated* velocity, so ``v = −out`` (the pipeline negates before the Euler step).
* CFG is the pipeline's: ``v = v_cond + w·(v_cond − v_neg)`` with the negative prompt ``""`` (note:
  ``w`` is added to 1, unlike SD3's ``v_neg + w·(v_cond − v_neg)``), both branches in one call of 2B
  rows; ``w = 0`` is one conditional pass. The pipeline's options ``cfg_truncation`` and
  ``cfg_normalization`` are used at their defaults (off). ``cfg_uncond_grad = False`` detaches ``v_neg``.
* ``sigmas(N)``: the pipeline's ``linspace(1, 1/N, N)`` through the scheduler (static shift 3.0 on
  the released checkpoints; a dynamic μ if the scheduler has one), then 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowcredit.models.diffusers_common import (
    DiffusersFlowModel,
    image_size,
    pretrained_options,
    scheduler_sigmas,
)


@dataclass
class ZCond:
    """Encoded prompts: ``embeds``, one ``(L_i, D)`` tensor per row (unpadded, as the pipeline keeps
    them); ``null`` the negative prompt's (one row). ``cond[idx]`` selects rows."""

    embeds: list[torch.Tensor]
    null: ZCond | None = None

    def __len__(self) -> int:
        return len(self.embeds)

    def __getitem__(self, idx) -> ZCond:
        if isinstance(idx, int):
            idx = [idx]
        elif isinstance(idx, slice):
            idx = range(len(self.embeds))[idx]
        return ZCond([self.embeds[int(i)] for i in idx], self.null)

    def expand(self, batch: int) -> ZCond:
        return ZCond(self.embeds[:1] * batch, self.null)


class ZImageFlowModel(DiffusersFlowModel):
    """``FlowModel`` adapter for Z-Image (see ``flowcredit.models.protocol``).

    Args:
        pipe: a loaded ``ZImagePipeline`` (only its components and ``encode_prompt`` are used).
        resolution: image side in pixels (int or ``(H, W)``, multiples of 16); 0/None: 1024.
        guidance_scale: the pipeline's CFG weight ``w`` (``v_cond + w·(v_cond − v_neg)``); None: 5.0,
            the pipeline's default (the distilled Z-Image-Turbo samples with 0: set it from Python).
        negative_prompt: the unconditional branch's prompt (``""``, the pipeline's).
        max_sequence_length: the Qwen3 text encoder's tokens, chat template included (longer prompts
            are cut; the padding is removed, so shorter prompts are unaffected); None: 512, the
            pipeline's.
    """

    pipeline_name = "ZImagePipeline"

    def __init__(
        self,
        pipe,
        resolution=None,
        guidance_scale: float | None = None,
        negative_prompt: str = "",
        max_sequence_length: int | None = None,
    ):
        factor = pipe.vae_scale_factor
        h, w = image_size(resolution, 1024, 2 * factor)
        super().__init__(pipe, h, w, (pipe.transformer.in_channels, h // factor, w // factor))
        self.guidance_scale = 5.0 if guidance_scale is None else float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.num_steps = 50
        self.set_max_sequence_length(max_sequence_length)

    @property
    def guidance_passes(self) -> int:
        """2 with CFG (``w > 0``, the pipeline's rule), else 1."""
        return 2 if self.guidance_scale > 0 else 1

    def _encode(self, prompts: list[str]) -> ZCond:
        """``[*prompts, negative_prompt]`` through the pipeline's ``encode_prompt`` (chat template, the
        text encoder's second-to-last hidden states, padding removed)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=[*prompts, self.negative_prompt],
            device=self.text_device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return ZCond(embeds[:-1], ZCond(embeds[-1:]))

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, embeds: list[torch.Tensor]) -> torch.Tensor:
        """One unguided pass: ``x (B, C, h, w)``, ``sigma (B,)`` → the velocity ``(B, C, h, w)`` float32."""
        dev, dtype = self.device, self.dtype
        t = (1000.0 - sigma.float().to(dev) * 1000.0) / 1000.0  # the pipeline's (1000 − t) / 1000
        out = self.net(
            list(x.to(dev, dtype).unsqueeze(2).unbind(0)),
            t,
            [e.to(dev, dtype) for e in embeds],
            return_dict=False,
        )[0]
        return -torch.stack([o.float() for o in out]).squeeze(2).to(x.device)

    def velocity(self, x: torch.Tensor, sigma, cond: ZCond) -> torch.Tensor:
        """``v_cond + w·(v_cond − v_neg)`` (``w = self.guidance_scale``; ``w = 0``: one pass).

        Args:
            x: ``(B, C, h, w)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``B`` rows.
        Returns:
            ``(B, C, h, w)`` float32.
        """
        b = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)  # (B,)
        w = self.guidance_scale
        if w <= 0:
            return self.predict(x, sigma, cond.embeds)
        null = cond.null.expand(b)
        v_cond, v_neg = self.guided_pair(
            lambda: self.predict(
                torch.cat([x, x]), torch.cat([sigma, sigma]), cond.embeds + null.embeds
            ).chunk(2),
            lambda: self.predict(x, sigma, cond.embeds),
            lambda: self.predict(x, sigma, null.embeds),
        )
        return v_cond + w * (v_cond - v_neg)

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """``(N + 1,)`` float32 as ``ZImagePipeline`` computes it: ``set_timesteps(sigmas=linspace(1, 1/N,
        N), mu=μ(h·w/4 tokens))``. ``shift`` is not used: the scheduler's own shift applies."""
        seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
        custom = torch.linspace(1.0, 1.0 / num_steps, num_steps).tolist()  # float32 values, as the pipeline's
        return scheduler_sigmas(self.scheduler, num_steps, sigmas=custom, image_seq_len=seq_len)


def load_for_training(cfg) -> ZImageFlowModel:
    """Trainer entry point: ``cfg.checkpoint`` in ``cfg.dtype`` at ``cfg.resolution`` (0: 1024);
    ``cfg.guidance_scale`` 0 keeps 5.0."""
    return ZImageFlowModel.from_pretrained(cfg.checkpoint, **pretrained_options(cfg))
