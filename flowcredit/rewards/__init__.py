"""Rewards: ``reward(images (B, 3, H, W) in [0, 1], prompts: list[str], metadata: list[dict]) -> (B,)``.

Resolve one with :func:`get_reward` from a registry name (``REWARDS``), a dotted path
``"pkg.mod:fn"``, or a weighted mix ``"shapes=1.0,jpeg_compressibility=0.1"`` (also a dict); a mix
reports each component, so the trainer can log ``reward/<name>``.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable

import numpy as np
import torch

RewardFn = Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]


def _shapes(images, prompts, metadata):
    from flowcredit.tasks.shapes import shapes_reward

    return shapes_reward(images, prompts, metadata)


def _jpeg_kb(images) -> np.ndarray:
    from PIL import Image

    arr = (
        (images.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy() * 255).round().astype(np.uint8)
    )
    sizes = []
    for img in arr:
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=95)
        sizes.append(buf.tell() / 1000.0)
    return np.asarray(sizes, dtype=np.float32)


def jpeg_compressibility(images, prompts, metadata):
    """DDPO's compressibility: minus the JPEG size (kB, quality 95)."""
    return -torch.from_numpy(_jpeg_kb(images))


def jpeg_incompressibility(images, prompts, metadata):
    """Plus the JPEG size (kB, quality 95)."""
    return torch.from_numpy(_jpeg_kb(images))


REWARDS: dict[str, RewardFn] = {
    "shapes": _shapes,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
}


def _resolve_one(name: str) -> RewardFn:
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"reward {name!r}: cannot import {attr!r} from {module!r} ({exc})") from exc
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(f"unknown reward {name!r}; registered: {sorted(REWARDS)} (or 'pkg.mod:fn')")


def parse_mix(spec: str | dict[str, float]) -> dict[str, float]:
    """``"a=1,b=0.5"`` or ``{"a": 1}`` or ``"a"`` → ``{name: weight}``."""
    if isinstance(spec, dict):
        return {str(k): float(v) for k, v in spec.items()}
    mix = {}
    for part in spec.split(","):
        name, _, weight = part.strip().partition("=")
        try:
            mix[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"reward mix {spec!r}: weight of {name!r} is not a number") from None
    return mix


class Reward:
    """A weighted mix of rewards; ``__call__`` returns the total ``(B,)`` and keeps the components."""

    def __init__(self, spec: str | dict[str, float]):
        self.weights = parse_mix(spec)
        self.fns = {name: _resolve_one(name) for name in self.weights}
        self.last_components: dict[str, torch.Tensor] = {}

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        self.last_components = {}
        for name, fn in self.fns.items():
            value = torch.as_tensor(fn(images, prompts, metadata), dtype=torch.float32).reshape(-1).cpu()
            if value.shape[0] != images.shape[0]:
                raise ValueError(
                    f"reward {name!r} returned {value.shape[0]} values for {images.shape[0]} images"
                )
            self.last_components[name] = value
            total = total + self.weights[name] * value
        return total


def get_reward(spec: str | dict[str, float], options: dict | None = None) -> Reward:
    """Resolve a reward spec (name, 'pkg.mod:fn', or weighted mix); ``options`` are per-reward kwargs."""
    if options:
        raise ValueError(f"reward_options given for {sorted(options)}, but no reward here takes options")
    return Reward(spec)
