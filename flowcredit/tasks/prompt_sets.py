"""Prompt sets for training and evaluation, read one way everywhere (trainer, ``eval``, ``calibrate``).

A set is a ShapeEval split (``"train"`` / ``"test"``), a JSONL file (one object with a string
``"prompt"`` per line, any other keys are metadata for the reward) or a text file (one prompt per
line). Bad input raises :class:`flowcredit.errors.UserError` naming the file and line; a missing file or
one that is not text names ``what`` too (the config field or flag that gave it).
"""

from __future__ import annotations

import json
from pathlib import Path

from flowcredit.errors import PathError, UserError, reading

SPLITS = ("train", "test", "confirm")
"""The ShapeEval sets a spec may name: the two splits and the confirmation set (issue 56)."""


def read_prompts(spec: str, shapes_metadata: bool = False, what: str = "prompt set") -> list[dict]:
    """All prompt metadata of ``spec``; ``shapes_metadata=True`` also requires every entry to be valid
    ShapeEval metadata (the ``shapes`` reward scores from it). ``what``: where ``spec`` came from (e.g.
    ``"config field 'train_prompts'"``, ``"--prompts"``), named by the error of a file not there or not
    text."""
    if spec in SPLITS:
        from flowcredit.tasks.shapes import load_prompts

        return load_prompts(spec)
    path = Path(spec)
    if not path.is_file():
        raise PathError(what, spec, f"not a ShapeEval split {SPLITS} nor an existing file")
    with reading(what, spec):
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        raise PathError(what, spec, "the file holds no prompts")
    if path.suffix != ".jsonl":
        metas = [{"prompt": ln} for ln in lines]
    else:
        metas = []
        for k, line in enumerate(lines):
            try:
                meta = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{spec}: line {k + 1} is not JSON ({exc.msg})") from None
            if not isinstance(meta, dict) or not isinstance(meta.get("prompt"), str):
                raise UserError(f"{spec}: line {k + 1} has no string 'prompt' field")
            metas.append(meta)
    if shapes_metadata:
        from flowcredit.tasks.shapes import validate_meta

        for k, meta in enumerate(metas):
            try:
                validate_meta(meta)
            except ValueError as exc:
                raise UserError(
                    f"{spec}: line {k + 1}: {exc}; a ShapeEval reward (the default, --reward shapes) scores "
                    "from ShapeEval metadata: for plain prompts choose another --reward"
                ) from None
    return metas


def load_prompt_set(
    spec: str, limit: int, spread: bool, shapes_metadata: bool = False, what: str = "prompt set"
) -> list[dict]:
    """:func:`read_prompts`, then the first ``limit`` prompts, or ``limit`` spread evenly (0: all)."""
    metas = read_prompts(spec, shapes_metadata, what)
    if not limit or limit >= len(metas):
        return metas
    if spread:
        step = len(metas) / limit
        return [metas[int(i * step)] for i in range(limit)]
    return metas[:limit]


def uniform_weights(metas: list[dict]) -> None:
    """Every prompt equally likely (``None``: the draw is a plain ``randint``)."""
    return None


def category_weights(metas: list[dict]) -> list[float]:
    """Every ``category`` equally likely, then every prompt within it: weight ``1 / n_category``. A
    prompt without a category counts as category ``""``. ShapeEval's train split is 56 % position
    prompts; balanced, each of its six categories gets 1/6 of the draws."""
    counts: dict[str, int] = {}
    for meta in metas:
        counts[meta.get("category", "")] = counts.get(meta.get("category", ""), 0) + 1
    return [1.0 / counts[meta.get("category", "")] for meta in metas]


PROMPT_WEIGHTS = {"uniform": uniform_weights, "category": category_weights}
"""How training prompts are drawn (``Config.prompt_weights``): a function of the prompt set returning a
weight per prompt (relative; ``None`` for uniform)."""
