"""ShapeEval's exact scene parse as a GenEval detector: every component of
:func:`flowcredit.tasks.shapes.reward.find_components` is one detection of its shape's class
(``circle``, ``square``, ``triangle``; an unclassified component is ``blob``) with score 1, its colour
name, and the box of the pixels it covers."""

from __future__ import annotations

import numpy as np

from flowcredit.tasks.geneval.rules import Found, Scene

CLASSES = ("circle", "square", "triangle")
"""The classes ShapeEval's prompts name."""


def parse(images) -> list[Scene]:
    """``images (B, 3, H, W)`` in [0, 1] → one :data:`Scene` per image."""
    from flowcredit.tasks.shapes.reward import BLOB, _to_numpy, find_components
    from flowcredit.tasks.shapes.scene import PALETTE, SHAPES

    comps = find_components(images)
    colors, shapes = [*PALETTE, "unknown"], list(SHAPES)
    scenes: list[Scene] = [{} for _ in range(_to_numpy(images).shape[0])]
    for i in np.argsort(comps["image"], kind="stable"):
        s = int(comps["shape"][i])
        name = "blob" if s == BLOB else shapes[s]
        box = tuple(float(comps[k][i]) for k in ("x0", "y0", "x1", "y1"))
        found = Found(box=box, score=1.0, color=colors[int(comps["color"][i])], index=int(i))
        scenes[int(comps["image"][i])].setdefault(name, []).append(found)
    return scenes
