"""ShapeEval scenes: palette, shape rasterisers, layout sampling and anti-aliased rendering.

A scene is a list of :class:`Placed` objects on a plain near-white background. Every shape is drawn
inside an axis-aligned square box of side ``extent`` pixels centred at ``(cx, cy)``; boxes keep a gap
of ``gap`` pixels (scaled with the image size) so that objects never touch. Rendering supersamples
each box ``SUPERSAMPLE``x per axis and averages, so edges are anti-aliased like a model's output.

Coordinates are in pixels: ``x`` grows to the right, ``y`` grows downwards (image rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

BACKGROUND = np.array([0.96, 0.96, 0.94], dtype=np.float32)
"""Background colour, RGB in [0, 1]."""

PALETTE: dict[str, np.ndarray] = {
    "red": np.array([0.86, 0.16, 0.16], dtype=np.float32),
    "green": np.array([0.15, 0.65, 0.25], dtype=np.float32),
    "blue": np.array([0.16, 0.30, 0.86], dtype=np.float32),
    "yellow": np.array([0.93, 0.80, 0.12], dtype=np.float32),
}
"""Object colours, RGB in [0, 1]. Distinct from each other and from ``BACKGROUND``."""


def _circle(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return u * u + v * v <= 0.25


def _square(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    return (np.abs(u) <= 0.5) & (np.abs(v) <= 0.5)


def _triangle(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    # Upward isosceles triangle filling the box: apex at the top centre, base along the bottom edge.
    return (v <= 0.5) & (np.abs(u) <= (v + 0.5) / 2)


SHAPES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "circle": _circle,
    "square": _square,
    "triangle": _triangle,
}
"""Rasterisers: ``(u, v) -> bool mask`` on box coordinates ``u, v`` in [-0.5, 0.5] (v downwards).
A new shape is one function and one entry here (plus a classifier rule in ``reward.py``)."""

RELATIONS: dict[str, tuple[float, float]] = {
    "left_of": (1.0, 0.0),
    "right_of": (-1.0, 0.0),
    "above": (0.0, 1.0),
    "below": (0.0, -1.0),
}
"""Relation ``a REL b`` -> unit direction ``(dx, dy)`` in which ``b`` lies as seen from ``a``."""

SUPERSAMPLE = 4
GAP = 2.0
"""Minimum gap between object boxes, in pixels at size 32 (scaled linearly with the size)."""
REFERENCE_SIZE = 32
GENERATOR_SLACK = 0.7
"""The generator places related objects with ``|across| <= 0.7 * along`` (the scorer accepts <= 1)."""


@dataclass(frozen=True)
class Placed:
    """One object of a scene: shape and colour names, box centre ``(cx, cy)`` and side ``extent``
    in pixels."""

    shape: str
    color: str
    cx: float
    cy: float
    extent: float


def relation_holds(rel: str, a: tuple[float, float], b: tuple[float, float], slack: float = 1.0) -> bool:
    """Whether ``a REL b`` holds for centres ``a = (x, y)``, ``b = (x, y)``.

    Holds iff ``b - a`` has a positive component ``along`` the relation's direction and a
    perpendicular component ``|across| <= slack * along`` (a cone of half-angle 45° for slack 1).
    """
    dx, dy = RELATIONS[rel]
    ox, oy = b[0] - a[0], b[1] - a[1]
    along = ox * dx + oy * dy
    across = abs(ox * dy - oy * dx)
    return bool(along > 0 and across <= slack * along)


def _extent_range(n_objects: int) -> tuple[float, float]:
    """Box side range as a fraction of the image size; smaller boxes when more objects must fit."""
    if n_objects <= 2:
        return 0.25, 0.36
    if n_objects == 3:
        return 0.23, 0.31
    return 0.22, 0.28


def _fits(box: np.ndarray, boxes: list[np.ndarray], gap: float | None) -> bool:
    """Whether ``box = (x0, y0, x1, y1)`` keeps at least ``gap`` pixels from every box in ``boxes``."""
    if gap is None:
        return True
    for o in boxes:
        if box[0] < o[2] + gap and o[0] < box[2] + gap and box[1] < o[3] + gap and o[1] < box[3] + gap:
            return False
    return True


def _place(
    specs: list[tuple[str, str]], rng: np.random.Generator, size: int, gap: float | None
) -> list[Placed] | None:
    """Sequentially places ``specs`` at random; returns the list of Placed or None if one did not fit."""
    lo, hi = _extent_range(len(specs))
    placed: list[Placed] = []
    boxes: list[np.ndarray] = []
    for shape, color in specs:
        for _ in range(50):
            e = rng.uniform(lo, hi) * size
            cx, cy = rng.uniform(e / 2 + 0.5, size - e / 2 - 0.5, size=2)
            box = np.array([cx - e / 2, cy - e / 2, cx + e / 2, cy + e / 2])
            if _fits(box, boxes, gap):
                placed.append(Placed(shape, color, float(cx), float(cy), float(e)))
                boxes.append(box)
                break
        else:
            return None
    return placed


def sample_scene(
    meta: dict, rng: np.random.Generator, size: int = 32, gap: float | None = GAP
) -> list[Placed]:
    """Random layout satisfying prompt metadata ``meta`` (see ``prompts.py``).

    Every object spec ``{"shape", "color", "count"}`` yields ``count`` objects; a ``relation``
    ``{"type", "a", "b"}`` between single objects is enforced with ``GENERATOR_SLACK``. ``gap`` is
    the minimum box gap in pixels at size 32; ``None`` allows overlaps. Objects are returned in spec
    order. Raises RuntimeError if no layout was found (only for impossible requests).
    """
    specs = [(o["shape"], o["color"]) for o in meta["objects"] for _ in range(int(o["count"]))]
    rel = meta.get("relation")
    scaled_gap = None if gap is None else gap * size / REFERENCE_SIZE
    for _ in range(200):
        placed = _place(specs, rng, size, scaled_gap)
        if placed is None:
            continue
        if rel is not None:
            a, b = placed[rel["a"]], placed[rel["b"]]
            if not relation_holds(rel["type"], (a.cx, a.cy), (b.cx, b.cy), GENERATOR_SLACK):
                continue
        return placed
    raise RuntimeError(f"no layout found for {meta.get('prompt')!r} at size {size}")


def _coverage(obj: Placed, size: int) -> tuple[slice, slice, np.ndarray]:
    """Anti-aliased coverage of ``obj``: the pixel window ``(rows, cols)`` and coverage (h, w) in [0, 1]."""
    half = obj.extent / 2
    x0, x1 = max(int(np.floor(obj.cx - half)), 0), min(int(np.ceil(obj.cx + half)), size)
    y0, y1 = max(int(np.floor(obj.cy - half)), 0), min(int(np.ceil(obj.cy + half)), size)
    s = SUPERSAMPLE
    sub = (np.arange(s) + 0.5) / s
    xs = (np.arange(x0, x1)[:, None] + sub).ravel()  # (w * s,) sample positions
    ys = (np.arange(y0, y1)[:, None] + sub).ravel()  # (h * s,)
    u = (xs[None, :] - obj.cx) / obj.extent
    v = (ys[:, None] - obj.cy) / obj.extent
    mask = SHAPES[obj.shape](u, v).astype(np.float32)  # (h * s, w * s)
    cov = mask.reshape(y1 - y0, s, x1 - x0, s).mean(axis=(1, 3))
    return slice(y0, y1), slice(x0, x1), cov


def render_scene(objects: list[Placed], size: int = 32) -> np.ndarray:
    """Renders a scene: returns an image (size, size, 3) float32 in [0, 1], objects painted in order."""
    img = np.broadcast_to(BACKGROUND, (size, size, 3)).copy()
    for obj in objects:
        rows, cols, cov = _coverage(obj, size)
        cov = cov[..., None]  # (h, w, 1)
        img[rows, cols] = img[rows, cols] * (1 - cov) + PALETTE[obj.color] * cov
    return img


def to_uint8(image: np.ndarray) -> np.ndarray:
    """Float image in [0, 1] -> uint8 image of the same shape (rounded)."""
    return np.clip(np.rint(image * 255), 0, 255).astype(np.uint8)


def render_prompt(
    meta: dict, rng: np.random.Generator, size: int = 32, gap: float | None = GAP
) -> np.ndarray:
    """A random image satisfying prompt metadata ``meta``: (size, size, 3) uint8."""
    return to_uint8(render_scene(sample_scene(meta, rng, size, gap), size))
