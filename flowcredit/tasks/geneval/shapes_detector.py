"""ShapeEval's exact scene parse as a GenEval detector: every component of
:func:`flowcredit.tasks.shapes.reward.find_components` is one detection of its shape's class
(``circle``, ``square``, ``triangle``; an unclassified component is ``blob``) with score 1, its colour
name, and the box of the pixels it covers.

Order: every score is 1, so GenEval's tie rule (:func:`.rules.geneval_order`: of equal scores the
later-listed first) alone decides which objects form a requirement's group. A class's detections are
listed in *reverse* component order (:func:`find_components`: by colour, then raster position), so the
rule ranks them in component order: a group is the first components, as it was before the rule engine
followed GenEval's tie order (same verdicts; ``tests/test_geneval_tie_order.py``)."""

from __future__ import annotations

import numpy as np

from flowcredit.tasks.geneval.rules import Found, Scene

CLASSES = ("circle", "square", "triangle")
"""The classes ShapeEval's prompts name."""


def parse(images) -> list[Scene]:
    """``images (B, 3, H, W)`` in [0, 1] → one :data:`Scene` per image, each class's detections in
    reverse component order (see the module docstring)."""
    from flowcredit.tasks.shapes.reward import BLOB, _to_numpy, find_components
    from flowcredit.tasks.shapes.scene import PALETTE, SHAPES

    comps = find_components(images)
    colors, shapes = [*PALETTE, "unknown"], list(SHAPES)
    scenes: list[Scene] = [{} for _ in range(_to_numpy(images).shape[0])]
    for i in np.argsort(comps["image"], kind="stable")[::-1]:  # each image's components, last first
        s = int(comps["shape"][i])
        name = "blob" if s == BLOB else shapes[s]
        box = tuple(float(comps[k][i]) for k in ("x0", "y0", "x1", "y1"))
        found = Found(box=box, score=1.0, color=colors[int(comps["color"][i])], index=int(i))
        scenes[int(comps["image"][i])].setdefault(name, []).append(found)
    return scenes
