"""The ``geneval`` reward: GenEval's rules (:mod:`.rules`) over one of two detectors.

``detector="mask2former"`` (default): Mask2Former instance segmentation over COCO's 80 classes and a
CLIP ViT-L/14 zero-shot colour classifier on each object's masked crop, both from local weights
(:mod:`.mask2former`); ``detector="shapes"``: ShapeEval's exact scene parse (:mod:`.shapes_detector`),
which also takes ShapeEval's own metadata (converted by :func:`.metadata.from_shapeeval`).
``score="partial"`` (default, for training) or ``"strict"`` (GenEval's pass/fail).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flowcredit.errors import UserError
from flowcredit.tasks.geneval.metadata import from_shapeeval, is_geneval, validate
from flowcredit.tasks.geneval.rules import GENEVAL, Scene, Settings, Verdict, check, known_colors
from flowcredit.tasks.geneval.shapes_detector import CLASSES as SHAPE_CLASSES
from flowcredit.tasks.geneval.shapes_detector import parse

SCORES = ("partial", "strict")


class ShapesDetector:
    """ShapeEval's exact parse with the :class:`Mask2FormerDetector` interface."""

    classes = SHAPE_CLASSES

    def __call__(self, images: torch.Tensor, metas: list[dict]) -> list[tuple[Scene, Callable]]:
        return [(scene, known_colors) for scene in parse(images)]


def _mask2former(**options):
    from flowcredit.tasks.geneval.mask2former import Mask2FormerDetector

    return Mask2FormerDetector(**options)


DETECTORS: dict[str, Callable] = {"mask2former": _mask2former, "shapes": lambda: ShapesDetector()}
"""``detector`` option → factory of the detector (its other options go to it)."""


def geneval_metadata(
    metas: list[dict], prompts: list[str], classes: tuple[str, ...], shapes: bool
) -> list[dict]:
    """Every prompt's metadata in GenEval's format, checked against the detector's ``classes``; ShapeEval
    metadata is converted when the detector is ShapeEval's parse. ``UserError`` names the prompt."""
    if metas is None or len(metas) != len(prompts):
        raise UserError(f"geneval reward needs one metadata dict per prompt: {len(prompts)} prompts")
    out = []
    for prompt, meta in zip(prompts, metas):
        if shapes and isinstance(meta, dict) and "objects" in meta and not is_geneval(meta):
            meta = from_shapeeval(meta)
        try:
            validate(meta, classes)
        except ValueError as exc:
            raise UserError(f"geneval reward: prompt {prompt!r}: {exc}") from None
        out.append(meta)
    return out


def geneval(*, detector: str = "mask2former", score: str = "partial", **options):
    """The reward ``(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` (``score`` of every
    image); it also has ``tabulate(images, prompts, metadata) -> {"soft", "strict", "category"}`` for
    the per-tag table of ``flowcredit eval`` (soft = the partial score)."""
    if detector not in DETECTORS:
        raise UserError(f"geneval reward: unknown detector {detector!r}; choose one of {sorted(DETECTORS)}")
    if score not in SCORES:
        raise UserError(f"geneval reward: score must be one of {SCORES}, got {score!r}")
    detect = DETECTORS[detector](**options)
    return GenEvalReward(detect, score, shapes=detector == "shapes")


class GenEvalReward:
    """See :func:`geneval`."""

    def __init__(self, detect, score: str, shapes: bool, settings: Settings = GENEVAL):
        self.detect, self.score, self.shapes, self.settings = detect, score, shapes, settings

    def check_metadata(self, metas: list[dict], source: str) -> None:
        """``UserError`` naming ``source``, the entry and the culprit unless every entry of ``metas`` is
        metadata this detector can score."""
        for k, meta in enumerate(metas):
            try:
                geneval_metadata([meta], [meta.get("prompt", "")], tuple(self.detect.classes), self.shapes)
            except UserError as exc:
                raise UserError(f"{source}: prompt {k + 1}: {exc}") from None

    def verdicts(self, images, prompts: list[str], metadata: list[dict]) -> list[Verdict]:
        """One :class:`Verdict` per image."""
        metas = geneval_metadata(metadata, prompts, tuple(self.detect.classes), self.shapes)
        found = self.detect(images, metas)
        return [check(scene, m, colors, self.settings) for (scene, colors), m in zip(found, metas)]

    def __call__(self, images, prompts, metadata) -> torch.Tensor:
        verdicts = self.verdicts(images, prompts, metadata)
        values = [float(v.strict) if self.score == "strict" else v.partial for v in verdicts]
        return torch.tensor(values, dtype=torch.float32)

    def tabulate(self, images, prompts, metadata) -> dict:
        verdicts = self.verdicts(images, prompts, metadata)
        tags = [m.get("tag") or m.get("category", "") for m in metadata]
        return {
            "soft": [v.partial for v in verdicts],
            "strict": [float(v.strict) for v in verdicts],
            "category": tags,
        }
