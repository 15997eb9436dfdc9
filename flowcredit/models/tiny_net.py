"""Networks of the built-in tiny model: a small text encoder and a conv U-Net (≈1.2 M parameters).

Design from the CPU feasibility study (``shared/notes/cpu-facts.md``): word embeddings (d = 64), two
pre-norm transformer layers, masked mean pooling to a 128-d vector; a U-Net with channels 32 and
multipliers (1, 2, 2), one residual block per level, FiLM from the time embedding plus the pooled
text, and one attention block at 8×8 whose keys are the image positions and the text tokens (so it
cross-attends to the caption). All projections are ``nn.Linear`` / ``nn.Conv2d`` so LoRA can wrap them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class Upsample2x(torch.autograd.Function):
    """Nearest 2× upsampling of ``h (B, C, H, W)`` → ``(B, C, 2H, 2W)``, bit for bit
    ``F.interpolate(h, scale_factor=2.0, mode="nearest")`` forward and backward: the forward is a
    broadcast copy (each pixel into its 2×2 block; about 3× faster than ``upsample_nearest2d``'s CPU
    kernel, which was 5 % of a ``skill`` iteration), the backward is aten's own
    ``upsample_nearest2d_backward``, so gradients sum in the same order."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        B, C, H, W = h.shape
        ctx.size = (B, C, H, W)
        return h[:, :, :, None, :, None].expand(B, C, H, 2, W, 2).reshape(B, C, 2 * H, 2 * W)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        B, C, H, W = ctx.size
        return torch.ops.aten.upsample_nearest2d_backward(grad, [2 * H, 2 * W], [B, C, H, W], 2.0, 2.0)


def upsample2x(h: torch.Tensor) -> torch.Tensor:
    """:class:`Upsample2x` on a contiguous (NCHW) ``h``; ``F.interpolate`` otherwise (e.g. channels-last,
    whose layout the broadcast copy would not keep)."""
    if h.is_contiguous():
        return Upsample2x.apply(h)
    return F.interpolate(h, scale_factor=2.0, mode="nearest")


class Attention(nn.Module):
    """Multi-head attention with separate query and key/value inputs and a key padding mask."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``x (B, N, D)`` attends to ``ctx (B, M, D)``; ``mask (B, M)`` bool, True = attend."""
        B, N, D = x.shape
        split = lambda t: t.view(B, t.shape[1], self.heads, D // self.heads).transpose(1, 2)
        q, k, v = split(self.q(x)), split(self.k(ctx)), split(self.v(ctx))  # (B, h, N|M, D/h)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, M)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, h, N, D/h)
        return self.out(o.transpose(1, 2).reshape(B, N, D))


class TextBlock(nn.Module):
    """Pre-norm transformer layer: self-attention then a GELU MLP, both residual."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, mask)
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    """Token ids to per-token features ``(B, L, dim)`` and a pooled vector ``(B, pooled_dim)``."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        pooled_dim: int = 128,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = nn.ModuleList(TextBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.Linear(dim, pooled_dim)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids, mask (B, L)`` → ``tokens (B, L, dim)``, ``pooled (B, pooled_dim)`` (masked mean)."""
        x = self.embed(ids) + self.pos[: ids.shape[1]]  # (B, L, D)
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm(x)
        m = mask.unsqueeze(-1).to(x.dtype)  # (B, L, 1)
        pooled = (x * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, D)
        return x, self.pool(pooled)


def timestep_features(sigma: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of ``1000·σ``: ``(B,)`` → ``(B, dim)``."""
    half = dim // 2
    freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, device=sigma.device) / half)  # (half,)
    angles = 1000.0 * sigma.float()[:, None] * freqs[None]  # (B, half)
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class ResBlock(nn.Module):
    """GroupNorm → SiLU → conv, FiLM (scale, shift) from the embedding, → SiLU → conv, residual."""

    def __init__(self, cin: int, cout: int, emb_dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(8, cin), nn.GroupNorm(8, cout)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.film = nn.Sequential(nn.SiLU(), nn.Linear(emb_dim, 2 * cout))
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B, Co, H, W)
        scale, shift = self.film(emb)[:, :, None, None].chunk(2, dim=1)  # (B, Co, 1, 1) each
        h = self.conv2(F.silu(self.norm2(h) * (1 + scale) + shift))
        return self.skip(x) + h


class ImageTextAttention(nn.Module):
    """Attention over the image positions with the projected text tokens appended to the keys."""

    def __init__(self, ch: int, text_dim: int, heads: int = 4):
        super().__init__()
        self.norm = nn.GroupNorm(8, ch)
        self.text_proj = nn.Linear(text_dim, ch)
        self.attn = Attention(ch, heads)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.norm(x).flatten(2).transpose(1, 2)  # (B, HW, C)
        ctx = torch.cat([h, self.text_proj(tokens).to(h.dtype)], dim=1)  # (B, HW + L, C)
        keep = torch.cat([mask.new_ones(B, H * W), mask], dim=1)  # (B, HW + L)
        out = self.attn(h, ctx, keep)  # (B, HW, C)
        return x + out.transpose(1, 2).reshape(B, C, H, W)


class UNet(nn.Module):
    """Conv U-Net velocity network conditioned on σ, pooled text (FiLM) and text tokens (attention)."""

    def __init__(
        self,
        channels: int = 32,
        mults: tuple[int, ...] = (1, 2, 2),
        text_dim: int = 64,
        pooled_dim: int = 128,
        emb_dim: int = 128,
        in_ch: int = 3,
    ):
        super().__init__()
        chs = [channels * m for m in mults]
        self.time_mlp = nn.Sequential(nn.Linear(emb_dim, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim))
        self.text_mlp = nn.Linear(pooled_dim, emb_dim)
        self.emb_dim = emb_dim
        self.stem = nn.Conv2d(in_ch, channels, 3, padding=1)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        prev = channels
        for i, ch in enumerate(chs):
            self.down.append(ResBlock(prev, ch, emb_dim))
            if i < len(chs) - 1:
                self.downsample.append(nn.Conv2d(ch, ch, 3, stride=2, padding=1))
            prev = ch
        self.mid1 = ResBlock(prev, prev, emb_dim)
        self.mid_attn = ImageTextAttention(prev, text_dim)
        self.mid2 = ResBlock(prev, prev, emb_dim)
        self.up = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for i, ch in reversed(list(enumerate(chs))):
            self.up.append(ResBlock(prev + ch, ch, emb_dim))
            prev = ch
            if i > 0:  # the conv after nearest upsampling also narrows to the next level's width
                self.upsample.append(nn.Conv2d(ch, chs[i - 1], 3, padding=1))
                prev = chs[i - 1]
        self.out_norm = nn.GroupNorm(8, prev)
        self.out = nn.Conv2d(prev, in_ch, 3, padding=1)
        self.gradient_checkpointing = False  # recompute each ResBlock in the backward (under grad)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        pooled: torch.Tensor,
    ) -> torch.Tensor:
        """``x (B, C, H, W)``, ``sigma (B,)``, ``tokens (B, L, Dt)``, ``mask (B, L)``, ``pooled (B, P)``
        → velocity ``(B, C, H, W)``."""
        emb = self.time_mlp(timestep_features(sigma, self.emb_dim)) + self.text_mlp(pooled)  # (B, E)
        h = self.stem(x)  # (B, c0, H, W)
        skips = []
        for i, block in enumerate(self.down):
            h = self._block(block, h, emb)
            skips.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)  # halves H, W
        h = self._block(self.mid1, h, emb)
        h = self._block(self.mid2, self.mid_attn(h, tokens, mask), emb)  # (B, c_last, H/4, W/4)
        for j, block in enumerate(self.up):
            h = self._block(block, torch.cat([h, skips.pop()], dim=1), emb)
            if j < len(self.upsample):
                h = self.upsample[j](upsample2x(h))
        return self.out(F.silu(self.out_norm(h)))

    def _block(self, block: nn.Module, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and torch.is_grad_enabled():
            return checkpoint(block, h, emb, use_reentrant=False)
        return block(h, emb)


class TinyNet(nn.Module):
    """All weights of the tiny model: ``text`` (TextEncoder) and ``unet`` (UNet).

    ``_no_split_modules`` and ``enable_gradient_checkpointing`` follow diffusers' names, so the
    adapter defaults (``fsdp_block_classes``, gradient checkpointing) apply as they do to diffusers.
    """

    _no_split_modules = ("ResBlock",)
    _supports_gradient_checkpointing = True

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        channels: int = 32,
        mults: tuple[int, ...] = (1, 2, 2),
        text_dim: int = 64,
        text_layers: int = 2,
        pooled_dim: int = 128,
    ):
        super().__init__()
        self.text = TextEncoder(vocab_size, max_len, text_dim, text_layers, pooled_dim=pooled_dim)
        self.unet = UNet(channels, mults, text_dim, pooled_dim)

    def forward(
        self,
        x: torch.Tensor,
        sigma: torch.Tensor | None = None,
        tokens: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        pooled: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``(x, sigma, tokens, mask, pooled)`` → the U-Net's velocity; ``(ids, mask=mask)`` alone →
        the text encoder's ``(tokens, pooled)``. Both go through this one entry point so that a
        wrapper of the whole network sees every call (FSDP2 gathers the root's weights in the root's
        forward, and requires the root to run first)."""
        if sigma is None:
            return self.text(x, mask)
        return self.unet(x, sigma, tokens, mask, pooled)

    def enable_gradient_checkpointing(self) -> None:
        self.unet.gradient_checkpointing = True
