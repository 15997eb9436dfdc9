"""Qwen-Image adapter built from ``QwenImagePipeline`` components.

* Our samplers see latents in the unpacked layout ``(B, C, h, w)`` (C = 16, h = H/8); ``velocity``
  packs them into 2×2 patch tokens ``(B, h·w/4, 4C)`` (the layout of ``QwenImagePipeline._pack_latents``,
  the same as FLUX's) and unpacks the output. ``decode`` adds the VAE's frame axis ``(B, C, 1, h, w)``,
  un-scales per channel as the pipeline does (``z = x / (1 / std) + mean``) and returns the frame.
* The transformer gets ``timestep = σ`` (the pipeline passes ``t / 1000`` after rounding ``t`` to the
  latents' dtype; so do we) and returns our ``v ≈ ε − x0`` (the scheduler's Euler step is
  ``x + (σ' − σ)·v``).
* CFG is the pipeline's *true CFG*: a conditional pass and a negative-prompt pass (``negative_prompt``,
  default ``" "``, the model card's), ``v = v_neg + w·(v_cond − v_neg)``, then rescaled per token to
  the conditional prediction's norm, ``v·‖v_cond‖/‖v‖`` (norms over each packed token's 4C values),
  all in float32. ``w`` is the pipeline's ``true_cfg_scale`` (default 4.0); ``w == 1``: one pass.
  ``cfg_uncond_grad = False`` detaches ``v_neg`` (the rescale's norms then see it as a constant).
  Prompt and negative prompt are encoded (and run) separately, as the pipeline does: their token
  lengths differ, and the text mask marks each batch's padding.
* ``sigmas(N)``: the pipeline's ``linspace(1, 1/N, N)`` through the scheduler's dynamic shift
  ``μ(h·w/4 tokens)`` (exponential time shift, terminal σ 0.02 on the released checkpoint), then 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flowcredit.models.diffusers_common import (
    DiffusersFlowModel,
    image_size,
    pretrained_options,
    scheduler_sigmas,
)
from flowcredit.models.flux import pack, unpack
from flowcredit.models.vae_decode import decode_wan_latents


@dataclass
class QwenCond:
    """Encoded prompts: ``embeds (B, L, D)`` and ``mask (B, L)`` (1: a token, 0: padding; None: no
    padding), ``null`` the negative prompt's encoding (batch 1). ``cond[idx]`` selects rows."""

    embeds: torch.Tensor
    mask: torch.Tensor | None
    null: QwenCond | None = None

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def __getitem__(self, idx) -> QwenCond:
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)
        if torch.is_tensor(idx):
            idx = idx.to(self.embeds.device)
        return QwenCond(self.embeds[idx], None if self.mask is None else self.mask[idx], self.null)

    def expand(self, batch: int) -> QwenCond:
        """A batch-1 encoding repeated to ``batch`` rows (views)."""
        mask = None if self.mask is None else self.mask.expand(batch, -1)
        return QwenCond(self.embeds.expand(batch, -1, -1), mask, self.null)


class QwenImageFlowModel(DiffusersFlowModel):
    """``FlowModel`` adapter for Qwen-Image (see ``flowcredit.models.protocol``).

    Args:
        pipe: a loaded ``QwenImagePipeline`` (only its components and ``encode_prompt`` are used).
        resolution: image side in pixels (int or ``(H, W)``, multiples of 16); 0/None: 1024 (the
            pipeline's ``128 × vae factor``).
        guidance_scale: true-CFG weight; None: 4.0 (the pipeline's ``true_cfg_scale``).
        negative_prompt: the unconditional branch's prompt (``" "``: the model card's).
        max_sequence_length: the Qwen2.5-VL text encoder's tokens kept after the chat template's
            prefix (longer prompts are cut; shorter ones are padded to the batch's longest, masked);
            at most 1024, the pipeline's bound; None: 512, the pipeline's default.
    """

    pipeline_name = "QwenImagePipeline"
    text_length_cap = 1024
    default_lora_targets = "to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out"

    def __init__(
        self,
        pipe,
        resolution=None,
        guidance_scale: float | None = None,
        negative_prompt: str = " ",
        max_sequence_length: int | None = None,
    ):
        factor = pipe.vae_scale_factor
        h, w = image_size(resolution, pipe.default_sample_size * factor, 2 * factor)
        channels = pipe.transformer.config.in_channels // 4
        super().__init__(pipe, h, w, (channels, h // factor, w // factor))
        self.guidance_scale = 4.0 if guidance_scale is None else float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.num_steps = 50
        self.set_max_sequence_length(max_sequence_length)

    def _encode(self, prompts: list[str]) -> QwenCond:
        """The pipeline's ``encode_prompt`` on the prompts (padded to the longest, with its mask) and,
        separately, on the negative prompt."""
        kw = {"device": self.text_device, "max_sequence_length": self.max_sequence_length}
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), **kw)
        null_embeds, null_mask = self.pipe.encode_prompt(prompt=[self.negative_prompt], **kw)
        return QwenCond(embeds, mask, QwenCond(null_embeds, null_mask))

    def predict(self, tokens: torch.Tensor, sigma: torch.Tensor, cond: QwenCond, h: int, w: int):
        """One unguided pass on packed ``tokens (B, h·w/4, 4C)``, ``sigma (B,)`` → float32 tokens."""
        dev, dtype = self.device, self.dtype
        out = self.net(
            hidden_states=tokens.to(dev, dtype),
            timestep=(sigma.to(dev) * 1000.0).to(dtype) / 1000.0,  # the pipeline's rounding of t / 1000
            encoder_hidden_states=cond.embeds.to(dev, dtype),
            encoder_hidden_states_mask=None if cond.mask is None else cond.mask.to(dev),
            img_shapes=[[(1, h // 2, w // 2)]] * tokens.shape[0],
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x: torch.Tensor, sigma, cond: QwenCond) -> torch.Tensor:
        """True CFG with the pipeline's norm rescale (see the module docstring).

        Args:
            x: ``(B, C, h, w)`` float32; sigma: ``(B,)`` (or a float) in [0, 1]; cond: ``B`` rows.
        Returns:
            ``(B, C, h, w)`` float32 on ``x.device``.
        """
        b, _, h, w = x.shape
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(b)  # (B,)
        tokens = pack(x.float())
        g = self.guidance_scale
        if g == 1.0:
            return unpack(self.predict(tokens, sigma, cond, h, w), h, w).to(x.device)

        def cond_pass():
            return self.predict(tokens, sigma, cond, h, w)  # (B, T, 4C)

        def neg_pass():
            return self.predict(tokens, sigma, cond.null.expand(b), h, w)

        v_cond, v_neg = self.guided_pair(lambda: (cond_pass(), neg_pass()), cond_pass, neg_pass)
        v = v_neg + g * (v_cond - v_neg)
        v = v * (v_cond.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        return unpack(v, h, w).to(x.device)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents ``(B, C, h, w)`` → images ``(B, 3, H, W)`` float32 in [0, 1] (a one-frame clip of
        the Wan VAE)."""
        return decode_wan_latents(self.vae, x[:, :, None], self.decode_chunk)[:, :, 0]

    def sigmas(self, num_steps: int, shift: float | None = None) -> torch.Tensor:
        """``(N + 1,)`` float32, as ``QwenImagePipeline`` computes it: ``set_timesteps(sigmas=linspace(1,
        1/N, N), mu=μ(h·w/4 tokens))``. ``shift`` is not used: the scheduler's own shift applies."""
        seq_len = (self.latent_shape[1] // 2) * (self.latent_shape[2] // 2)
        custom = np.linspace(1.0, 1.0 / num_steps, num_steps)
        return scheduler_sigmas(self.scheduler, num_steps, sigmas=custom, image_seq_len=seq_len)


def load_for_training(cfg) -> QwenImageFlowModel:
    """Trainer entry point: ``cfg.checkpoint`` in ``cfg.dtype`` at ``cfg.resolution`` (0: 1024);
    ``cfg.guidance_scale`` 0 keeps 4.0."""
    return QwenImageFlowModel.from_pretrained(cfg.checkpoint, **pretrained_options(cfg))
