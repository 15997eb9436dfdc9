"""The per-sample metadata checks of the rewards that score from metadata: ``shapes``,
``shapes_strict`` and ``geneval``. Each names the first sample whose metadata it cannot score with a
:class:`~flowcredit.rewards.RewardInputError` (``metadata[i]: why``), so that a reward server answers
a client's bad metadata with what is wrong (422) rather than an error id.

- ``shapes``, ``shapes_strict`` (:mod:`flowcredit.tasks.shapes.reward`): ShapeEval metadata,
  ``{"prompt", "category", "objects": [{"shape", "color", "count"}, ...]}`` plus ``"relation"`` for the
  category ``position``, as every line of a ShapeEval prompt set holds (docs/shapeeval.md); the prompt
  must be the metadata's ``"prompt"``.
- ``geneval`` (:mod:`flowcredit.tasks.geneval.reward`): GenEval metadata, ``{"include": [{"class",
  "count", ...}, ...], "exclude"?}`` with the detector's classes (docs/geneval.md); its ``shapes``
  detector takes ShapeEval metadata too.
"""

from __future__ import annotations

import json

from flowcredit.errors import UserError
from flowcredit.rewards.errors import RewardInputError

KEYS = ("prompt", "category", "objects")
"""Keys every ShapeEval metadata object has (``relation`` too for the category ``position``)."""


def _example() -> str:
    from flowcredit.tasks.shapes.prompts import make_meta

    return json.dumps(make_meta("single_object", [("red", "circle", 1)]))


def _quoted(names) -> str:
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_shapes_metadata(reward: str, prompts: list[str], metadata: list[dict]) -> None:
    """:class:`RewardInputError` naming the first sample whose metadata ``reward`` cannot score: not
    an object, a key of :data:`KEYS` missing, or malformed (the cause from
    :func:`~flowcredit.tasks.shapes.prompts.validate_meta`, e.g. an unknown colour, or metadata of
    another prompt). A count mismatch is left to the scorer (a caller's bug, not a sample's input)."""
    from flowcredit.tasks.shapes.prompts import validate_meta

    if metadata is None or len(metadata) != len(prompts):
        return
    for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
        if not isinstance(meta, dict):
            got = "nothing" if meta is None else type(meta).__name__
            reason = f"the {reward} reward needs ShapeEval metadata, an object like {_example()}; got {got}"
            raise RewardInputError("metadata", i, reason)
        missing = [key for key in KEYS if key not in meta]
        if missing:
            holds = f"{', '.join(map(repr, KEYS))} and, for the category 'position', 'relation'"
            reason = f"the {reward} reward needs {_quoted(missing)} (ShapeEval metadata holds {holds}; e.g. "
            raise RewardInputError("metadata", i, reason + f"{_example()})")
        try:
            validate_meta(meta, prompt)
        except ValueError as exc:  # validate_meta's own checks: they quote the metadata only
            raise RewardInputError("metadata", i, f"the {reward} reward cannot score it: {exc}") from None


class GenEvalChecked:
    """The ``geneval`` reward with each sample's metadata checked first (:class:`RewardInputError`
    naming the sample); every other attribute (``tabulate``, ``check_metadata``, ``jpeg_quality``, ...)
    is the wrapped :class:`~flowcredit.tasks.geneval.reward.GenEvalReward`'s."""

    def __init__(self, reward):
        self.reward = reward

    def __getattr__(self, name: str):
        if "reward" not in self.__dict__:  # while unpickling
            raise AttributeError(name)
        return getattr(self.reward, name)

    def __call__(self, images, prompts: list[str], metadata: list[dict]):
        from flowcredit.tasks.geneval.reward import geneval_metadata

        if metadata is not None and len(metadata) == len(prompts):
            classes = tuple(self.reward.detect.classes)
            for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
                try:
                    geneval_metadata([meta], [prompt], classes, self.reward.shapes)
                except UserError as exc:  # its messages quote the metadata and the detector's classes
                    raise RewardInputError("metadata", i, str(exc)) from None
        return self.reward(images, prompts, metadata)
