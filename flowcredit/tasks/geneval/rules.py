"""GenEval's compositional rules over detections (Ghosh et al. 2023, "GenEval: An Object-Focused
Framework for Evaluating Text-to-Image Alignment"), written from the paper and its metadata format.

A prompt's metadata is ``{"tag", "prompt", "include": [req, …], "exclude": [req, …]}``; a requirement
is ``{"class", "count"}`` plus, in ``include``, an optional ``"color"`` and an optional
``"position": [relation, j]`` (this object is ``relation`` of the objects of include ``j < i``).

The rules (:func:`check`), over the detections kept by :func:`visible` (score above the threshold —
0.3, or 0.9 for the ``counting`` tag — highest first, of equal scores the later-listed first as in
GenEval's script (:func:`geneval_order`), at most 16 per class):

- include ``{class, count}``: at least ``count`` objects of the class; the first ``count`` (highest
  scores) are the requirement's *group*;
- ``color``: every object of the group has that colour (the detector's colour classifier);
- ``position``: every object of the group stands in ``relation`` to every object of group ``j``, and
  group ``j`` itself was matched; relations from box geometry (:func:`relations`);
- exclude ``{class, count}``: fewer than ``count`` objects of the class (counting prompts exclude
  ``count + 1``); objects of classes no requirement names are allowed.

``strict`` is GenEval's score (the image passes every rule). ``partial`` is ours, for training (GenEval
defines none; Flow-GRPO's server returns a partial score whose rule its paper does not state): the mean
of one credit in [0, 1] per check — count ``min(n, count) / count``, colour the fraction of the group
with the colour (over ``count``), position the fraction of (object, target) pairs in the relation
(0 without both groups), exclude 0 or 1. Every credit is 1 exactly when its rule holds, so
``strict == (partial == 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
"""GenEval's colour vocabulary (the colour classifier chooses among these)."""
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


@dataclass(frozen=True)
class Settings:
    """GenEval's detection and geometry constants (its evaluation script's defaults)."""

    threshold: float = 0.3
    """Detection score a non-counting prompt's objects must exceed."""
    counting_threshold: float = 0.9
    """The same for the ``counting`` tag."""
    max_objects: int = 16
    """Detections kept per class (highest scores)."""
    position_margin: float = 0.1
    """Centre offsets shrink by this fraction of the two boxes' summed sizes before the direction test."""


GENEVAL = Settings()
"""GenEval's own constants."""


@dataclass(frozen=True)
class Found:
    """One detection: ``box (x0, y0, x1, y1)`` in pixels (y down), ``score`` in [0, 1], and ``color``
    when the detector knows it already (an exact parse); ``index`` lets a colour classifier find the
    detection's mask."""

    box: tuple[float, float, float, float]
    score: float = 1.0
    color: str | None = None
    index: int = -1


Scene = dict[str, list[Found]]
"""Detections of one image by class name."""
ColorFn = Callable[[str, list[Found]], list[str]]
"""``colors(class, group) -> colour name per object`` for one image."""


@dataclass
class Verdict:
    """One image's result: GenEval's ``strict`` pass, our ``partial`` credit, the failed rules."""

    strict: bool
    partial: float
    credits: list[float] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)


def geneval_order(found: list[Found]) -> list[Found]:
    """``found`` highest score first, of equal scores the *later-listed* first: GenEval's
    ``np.argsort(scores)[::-1]`` (``evaluation/evaluate_images.py``, ``evaluate_image``).

    GenEval pins numpy 1.23.1, whose default argsort (introsort) sorts a short array by insertion sort,
    which is stable (checked with numpy 1.23.5: ties keep their order in every float32 array of up to 16
    elements, not from 17), so the reversal puts the later of two equal scores first. Deviation: where
    numpy leaves the order of ties unspecified (more than 16 detections of a class, counted before the
    threshold; a numpy whose argsort uses SIMD sorts, e.g. 2.x on AVX-512) this order still holds."""
    return sorted(reversed(found), key=lambda f: -f.score)


def visible(scene: Scene, tag: str, settings: Settings = GENEVAL) -> Scene:
    """Detections above the tag's threshold in :func:`geneval_order`, at most ``max_objects`` per class."""
    threshold = settings.counting_threshold if tag == "counting" else settings.threshold
    out = {}
    for name, found in scene.items():
        kept = [f for f in geneval_order(found) if f.score > threshold]
        out[name] = kept[: settings.max_objects]
    return out


def relations(a: tuple, b: tuple, margin: float = 0.1) -> set[str]:
    """Relations of box ``a`` to box ``b`` (``(x0, y0, x1, y1)``, y down): GenEval's geometry.

    The centre offset ``o = c_a − c_b`` shrinks per axis by ``margin · (size_a + size_b)`` (towards 0,
    not past it); if nothing is left, no relation. Otherwise with ``(dx, dy) = shrunk / |o|``:
    ``left of`` if dx < −½, ``right of`` if dx > ½, ``above`` if dy < −½, ``below`` if dy > ½.
    """
    boxes = np.asarray([a, b], dtype=np.float64).reshape(2, 2, 2)  # (box, corner, xy)
    centre = boxes.mean(axis=1)  # (2, 2)
    size = np.abs(boxes[:, 1] - boxes[:, 0])  # (2, 2)
    offset = centre[0] - centre[1]
    shrunk = np.maximum(np.abs(offset) - margin * (size[0] + size[1]), 0) * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def known_colors(klass: str, group: list[Found]) -> list[str]:
    """The :data:`ColorFn` of a detector that sets ``Found.color`` itself."""
    return [f.color or "" for f in group]


def check(scene: Scene, meta: dict, colors: ColorFn = known_colors, settings: Settings = GENEVAL) -> Verdict:
    """GenEval's rules for one image (see the module docstring); ``scene`` as the detector gave it."""
    scene = visible(scene, meta.get("tag", ""), settings)
    credits: list[float] = []
    reasons: list[str] = []
    groups: list[list[Found] | None] = []  # per include: its group if every rule of it held
    for req in meta["include"]:
        name, count = req["class"], int(req["count"])
        group = scene.get(name, [])[:count]
        ok = _credit(credits, reasons, len(group) / count, f"expected {name} >= {count}, found {len(group)}")
        if "color" in req:
            got = colors(name, group) if group else []
            n_right = sum(c == req["color"] for c in got)
            ok &= _credit(credits, reasons, n_right / count, f"expected {req['color']} {name} >= {count}")
        if "position" in req:
            rel, target = req["position"]
            ok &= _credit(
                credits,
                reasons,
                _position_credit(group, groups, target, rel, settings),
                f"{name} not {rel} target {target}",
            )
        groups.append(group if ok else None)
    for req in meta.get("exclude", []):
        n = len(scene.get(req["class"], []))
        _credit(
            credits,
            reasons,
            float(n < int(req["count"])),
            f"expected {req['class']} < {req['count']}, found {n}",
        )
    partial = float(np.mean(credits)) if credits else 0.0
    return Verdict(strict=not reasons, partial=partial, credits=credits, reasons=reasons)


def _credit(credits: list[float], reasons: list[str], value: float, reason: str) -> bool:
    """Record one check's credit (capped at 1); a credit below 1 records ``reason``. Returns ok."""
    value = min(float(value), 1.0)
    credits.append(value)
    if value < 1.0:
        reasons.append(reason)
    return value == 1.0


def _position_credit(group, groups, target: int, rel: str, settings: Settings) -> float:
    """Fraction of (object, target object) pairs with ``rel``; 0 if either group is missing."""
    targets = groups[target] if 0 <= target < len(groups) else None
    if not group or not targets:
        return 0.0
    pairs = [rel in relations(a.box, b.box, settings.position_margin) for a in group for b in targets]
    return float(np.mean(pairs))
