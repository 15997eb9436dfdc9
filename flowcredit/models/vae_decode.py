"""Scaled latents → images through a diffusers VAE, in row chunks (a VAE decode at 1024² needs GBs of
activations): the SD3/FLUX.1 VAE (:func:`decode_latents`) and the Wan VAE of Wan2.1 and Qwen-Image
(:func:`decode_wan_latents`)."""

from __future__ import annotations

import torch


def decode_latents(vae, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Scaled latents ``(B, C, h, w)`` → images ``(B, 3, H, W)`` float32 in [0, 1] on ``x.device``.

    Un-scales as diffusers' pipelines do, ``z = x / scaling_factor + shift_factor``, decodes in chunks
    of ``chunk`` rows (a VAE decode at 1024² needs GBs of activations) and maps ``[-1, 1] → [0, 1]``.
    """
    scale = vae.config.scaling_factor
    shift = vae.config.shift_factor or 0.0
    dev, dtype = vae.device, vae.dtype
    out = []
    with torch.no_grad():
        for lo in range(0, x.shape[0], chunk):
            z = x[lo : lo + chunk].to(dev, dtype) / scale + shift
            img = vae.decode(z, return_dict=False)[0]
            out.append((img.float() / 2 + 0.5).clamp(0, 1).to(x.device))
    return torch.cat(out)


def decode_wan_latents(vae, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Latents ``(B, C, F', h, w)`` of a Wan VAE (Wan2.1, Qwen-Image) → its decoded ``(B, 3, F, H, W)``
    in [0, 1] on ``x.device``, un-scaled as the pipelines do (``z = x / (1 / std) + mean`` per
    channel), ``chunk`` rows at a time."""
    cfg, dev = vae.config, vae.device
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1).to(dev)
    inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1).to(dev)
    out = []
    with torch.no_grad():
        for lo in range(0, x.shape[0], chunk):
            z = x[lo : lo + chunk].to(dev, torch.float32) / inv_std + mean
            video = vae.decode(z, return_dict=False)[0]  # (b, 3, F, H, W) in [-1, 1]
            out.append((video.float() / 2 + 0.5).clamp(0, 1).to(x.device))
    return torch.cat(out)
