"""GenEval's prompt metadata: validation against a detector's classes, and ShapeEval metadata
written in GenEval's format (so that the rule engine scores ShapeEval prompts too).

Format (one JSON object per line): ``{"tag", "prompt", "include": [{"class", "count", "color"?,
"position"?: [relation, j]}], "exclude"?: [{"class", "count"}]}``.
"""

from __future__ import annotations

from flowcredit.tasks.geneval.rules import COLORS, RELATIONS

COCO_CLASSES = (
    *("person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat"),
    *("traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog"),
    *("horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella"),
    *("handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite"),
    *("baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle"),
    *("wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich", "orange"),
    *("broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch", "potted plant"),
    *("bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote", "keyboard", "cell phone"),
    *("microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock", "vase", "scissors"),
    *("teddy bear", "hair drier", "toothbrush"),
)
"""The 80 COCO object classes GenEval's prompts name (the detector's label set, in COCO order)."""


def validate(meta: object, classes: tuple[str, ...] | None = None) -> None:
    """Raise ``ValueError`` naming the culprit (``include[i]: …``) unless ``meta`` is GenEval metadata
    whose classes are all in ``classes`` (``None``: any class). The message does not name the prompt:
    the caller does (it knows the file and line too)."""
    if not isinstance(meta, dict):
        raise ValueError(f"GenEval metadata must be a JSON object, got {type(meta).__name__}")
    include = meta.get("include")
    if not isinstance(include, list) or not include:
        raise ValueError("GenEval metadata needs a non-empty 'include' list")
    for i, req in enumerate(include):
        _requirement(req, f"include[{i}]", classes)
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"include[{i}]: unknown colour {req['color']!r}; GenEval's: {', '.join(COLORS)}")
        if "position" in req:
            pos = req["position"]
            ok = isinstance(pos, list) and len(pos) == 2 and pos[0] in RELATIONS
            if not ok or not isinstance(pos[1], int) or not 0 <= pos[1] < i:
                raise ValueError(
                    f"include[{i}]: 'position' must be [relation in {RELATIONS}, index of an "
                    f"earlier include], got {pos!r}"
                )
    for i, req in enumerate(meta.get("exclude", [])):
        _requirement(req, f"exclude[{i}]", classes)


def _requirement(req: object, where: str, classes: tuple[str, ...] | None) -> None:
    if not isinstance(req, dict) or not isinstance(req.get("class"), str):
        raise ValueError(f"{where}: a requirement needs a string 'class'")
    if classes is not None and req["class"] not in classes:
        raise ValueError(f"{where}: unknown class {req['class']!r}; the detector's: {', '.join(classes)}")
    count = req.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(f"{where}: 'count' must be an integer >= 1, got {count!r}")


def is_geneval(meta: object) -> bool:
    """Whether ``meta`` is written in GenEval's format (it has an ``include`` list)."""
    return isinstance(meta, dict) and "include" in meta


SHAPE_RELATIONS = {"left_of": "left of", "right_of": "right of", "above": "above", "below": "below"}


def from_shapeeval(meta: dict) -> dict:
    """ShapeEval metadata in GenEval's format: one include per object spec with its shape as the class
    and its colour (every ShapeEval object names one); ``counting`` excludes ``count + 1``;
    ``a REL b`` becomes include ``[b, a + position [REL, 0]]`` (GenEval's targets come first)."""
    specs = [{"class": o["shape"], "count": int(o["count"]), "color": o["color"]} for o in meta["objects"]]
    out = {"tag": meta["category"], "prompt": meta["prompt"], "include": specs}
    rel = meta.get("relation")
    if rel is not None:
        a, b = specs[rel["a"]], specs[rel["b"]]
        out["include"] = [b, {**a, "position": [SHAPE_RELATIONS[rel["type"]], 0]}]
    if meta["category"] == "counting":
        out["exclude"] = [{"class": s["class"], "count": s["count"] + 1} for s in specs]
    return out
