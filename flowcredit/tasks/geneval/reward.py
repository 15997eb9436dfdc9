"""The ``geneval`` reward: GenEval's rules (:mod:`.rules`) over one of two detectors.

``detector="mask2former"`` (default): Mask2Former instance segmentation over COCO's 80 classes and a
CLIP ViT-L/14 zero-shot colour classifier on each object's masked crop, both from local weights
(:mod:`.mask2former`; the CLIP loader comes from the reward registry, ``flowcredit.rewards``, since
task code never imports rewards); ``detector="shapes"``: ShapeEval's exact scene parse
(:mod:`.shapes_detector`), which also takes ShapeEval's own metadata (converted by
:func:`.metadata.from_shapeeval`). ``score="partial"`` (default, for training) or ``"strict"``
(GenEval's pass/fail). ``jpeg_quality``: Flow-GRPO's JPEG step before detection (:func:`jpeg_round_trip`).
"""

from __future__ import annotations

import inspect
import io
from collections.abc import Callable

import numpy as np
import torch

from flowcredit.errors import UserError
from flowcredit.tasks.geneval.metadata import from_shapeeval, is_geneval, validate
from flowcredit.tasks.geneval.rules import GENEVAL, Scene, Settings, Verdict, check, known_colors
from flowcredit.tasks.geneval.shapes_detector import CLASSES as SHAPE_CLASSES
from flowcredit.tasks.geneval.shapes_detector import parse

SCORES = ("partial", "strict")
MAX_JPEG_QUALITY = 95
"""PIL's advice: above 95 JPEG grows without gaining quality."""


class ShapesDetector:
    """ShapeEval's exact parse with the :class:`Mask2FormerDetector` interface."""

    classes = SHAPE_CLASSES

    def __call__(self, images: torch.Tensor, metas: list[dict]) -> list[tuple[Scene, Callable]]:
        return [(scene, known_colors) for scene in parse(images)]


def _mask2former():
    from flowcredit.tasks.geneval.mask2former import Mask2FormerDetector

    return Mask2FormerDetector


DETECTORS: dict[str, Callable[[], type]] = {"mask2former": _mask2former, "shapes": lambda: ShapesDetector}
"""``detector`` option → the detector's class (imported on use); its other options go to it."""
INTERNAL = ("clip_loader",)
"""Detector arguments the registry passes, not options a user sets."""


def jpeg_quality_option(value: object) -> int:
    """``jpeg_quality`` checked: 0 (off) or a PIL JPEG quality 1–95; ``UserError`` naming it otherwise."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_JPEG_QUALITY
    if not ok:
        raise UserError(
            f"geneval reward: option 'jpeg_quality' must be 0 (off) or an integer JPEG quality 1-"
            f"{MAX_JPEG_QUALITY} (Flow-GRPO: 75), got {value!r}"
        )
    return value


def jpeg_round_trip(images: torch.Tensor, quality: int) -> torch.Tensor:
    """Flow-GRPO's JPEG step (``flow_grpo/rewards.py``, ``geneval_score``: the images go to its GenEval
    server as JPEG bytes, PIL's default quality 75): ``images (B, 3, H, W)`` in [0, 1] → uint8
    ``(x · 255).round()`` (clamped) → PIL ``save(format="JPEG", quality=quality)`` → decoded, ``/ 255``
    → float32 ``(B, 3, H, W)`` on the input's device."""
    from PIL import Image

    if images.shape[0] == 0:
        return images.float()
    pixels = (images.detach().float() * 255).round().clamp(0, 255).to(torch.uint8)
    out = []
    for img in pixels.permute(0, 2, 3, 1).cpu().numpy():
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=quality)
        buf.seek(0)
        out.append(np.asarray(Image.open(buf).convert("RGB")))
    return torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2).float().div(255).to(images.device)


def geneval_metadata(
    metas: list[dict], prompts: list[str], classes: tuple[str, ...], shapes: bool
) -> list[dict]:
    """Every prompt's metadata in GenEval's format, checked against the detector's ``classes``; ShapeEval
    metadata is converted when the detector is ShapeEval's parse. ``UserError`` names the prompt once."""
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


def _check_detector_options(detector: str, cls: type, options: dict) -> None:
    """``UserError`` naming the option unless the detector's class takes every one of ``options`` and
    is given every option it requires."""
    params = inspect.signature(cls).parameters
    accepted = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY and n not in INTERNAL]
    for option in options:
        if option not in accepted:
            raise UserError(
                f"geneval reward: detector {detector!r} has no option {option!r}; its options: "
                f"{accepted or 'none'} (and the reward's: detector, score, jpeg_quality)"
            )
    for name in accepted:
        if params[name].default is inspect.Parameter.empty and name not in options:
            raise UserError(
                f"geneval reward: detector {detector!r} needs option {name!r}: "
                f'reward_options=\'{{"geneval": {{"{name}": ...}}}}\''
            )


def geneval(
    *,
    detector: str = "mask2former",
    score: str = "partial",
    jpeg_quality: int = 0,
    clip_loader: Callable | None = None,
    **options,
):
    """The reward ``(images (B, 3, H, W) in [0, 1], prompts, metadata) -> (B,)`` (``score`` of every
    image); it also has ``tabulate(images, prompts, metadata) -> {"soft", "strict", "category"}`` for
    the per-tag table of ``flowcredit eval`` (soft = the partial score). ``jpeg_quality`` > 0 passes
    every image through :func:`jpeg_round_trip` first. ``clip_loader``: the Mask2Former detector's CLIP
    loader (the registry's ``geneval`` entry gives :func:`flowcredit.rewards.clip.load_clip`)."""
    if detector not in DETECTORS:
        raise UserError(f"geneval reward: unknown detector {detector!r}; choose one of {sorted(DETECTORS)}")
    if score not in SCORES:
        raise UserError(f"geneval reward: score must be one of {SCORES}, got {score!r}")
    jpeg_quality = jpeg_quality_option(jpeg_quality)
    cls = DETECTORS[detector]()
    _check_detector_options(detector, cls, options)
    if "clip_loader" in inspect.signature(cls).parameters:
        options["clip_loader"] = clip_loader
    return GenEvalReward(cls(**options), score, shapes=detector == "shapes", jpeg_quality=jpeg_quality)


class GenEvalReward:
    """See :func:`geneval`."""

    def __init__(self, detect, score: str, shapes: bool, settings: Settings = GENEVAL, jpeg_quality: int = 0):
        self.detect, self.score, self.shapes, self.settings = detect, score, shapes, settings
        self.jpeg_quality = jpeg_quality

    def check_metadata(self, metas: list[dict], source: str) -> None:
        """``UserError`` naming ``source``, the line and the culprit unless every entry of ``metas`` is
        metadata this detector can score."""
        for k, meta in enumerate(metas):
            prompt = meta.get("prompt", "") if isinstance(meta, dict) else ""
            try:
                geneval_metadata([meta], [prompt], tuple(self.detect.classes), self.shapes)
            except UserError as exc:
                raise UserError(f"{source}: line {k + 1}: {exc}") from None

    def verdicts(self, images, prompts: list[str], metadata: list[dict]) -> list[Verdict]:
        """One :class:`Verdict` per image (after the JPEG step when ``jpeg_quality`` is set)."""
        metas = geneval_metadata(metadata, prompts, tuple(self.detect.classes), self.shapes)
        if self.jpeg_quality:
            images = jpeg_round_trip(images, self.jpeg_quality)
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
