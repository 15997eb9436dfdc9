"""ShapeEval prompts: caption templates, structured metadata, the train/test split and JSONL I/O.

A prompt is a JSON-serialisable dict::

    {"prompt": "a red circle to the left of a blue square", "category": "position",
     "objects": [{"shape": "circle", "color": "red", "count": 1},
                 {"shape": "square", "color": "blue", "count": 1}],
     "relation": {"type": "left_of", "a": 0, "b": 1}}

``relation`` is present for ``position`` only. The caption is a pure function of the rest
(:func:`caption`), so metadata can be checked against its prompt string. Run
``python -m flowcredit.tasks.shapes.prompts`` to regenerate the shipped ``shapes_{train,test}.jsonl``
and the confirmation set ``shapes_confirm.jsonl`` (:func:`confirmation_prompts`).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
from importlib import resources
from pathlib import Path

import numpy as np

from flowcredit.tasks.shapes.scene import PALETTE, RELATIONS, SHAPES, render_scene, sample_scene

COLORS = tuple(PALETTE)
SHAPE_NAMES = tuple(SHAPES)
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATION_WORDS = {
    "left_of": "to the left of",
    "right_of": "to the right of",
    "above": "above",
    "below": "below",
}
CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
SPLITS = ("train", "test")
"""The partition of :func:`all_prompts`."""
SETS = (*SPLITS, "confirm")
"""The shipped prompt sets (:func:`load_prompts`): the two splits and the confirmation set."""

HOLDOUT = {"single_object": 3, "colors": 3, "counting": 12, "two_object": 8, "color_attr": 6, "position": 5}
"""Per category, how many combination keys (see :func:`combination_key`) are held out for ``test``."""


def _plural(shape: str) -> str:
    return shape + "s"


def caption(meta: dict) -> str:
    """The caption of metadata ``meta`` (lowercase words separated by single spaces)."""
    cat, objs = meta["category"], meta["objects"]
    (c0, s0), n0 = (objs[0]["color"], objs[0]["shape"]), objs[0]["count"]
    if cat == "single_object":
        return f"a {c0} {s0}"
    if cat == "colors":
        return f"a {s0} that is {c0}"
    if cat == "counting":
        return f"{NUMBERS[n0]} {c0} {s0 if n0 == 1 else _plural(s0)}"
    c1, s1 = objs[1]["color"], objs[1]["shape"]
    if cat == "two_object":
        return f"a {c0} {s0} and a {c1} {s1}"
    if cat == "color_attr":
        return f"a {s0} that is {c0} and a {s1} that is {c1}"
    if cat == "position":
        return f"a {c0} {s0} {RELATION_WORDS[meta['relation']['type']]} a {c1} {s1}"
    raise ValueError(f"unknown category {cat!r}; choices: {CATEGORIES}")


def make_meta(category: str, objects: list[tuple[str, str, int]], relation: str | None = None) -> dict:
    """Metadata dict for ``category`` from ``objects = [(color, shape, count), ...]`` and an optional
    relation type (``position`` only: object 0 REL object 1)."""
    meta = {
        "prompt": "",
        "category": category,
        "objects": [{"shape": s, "color": c, "count": int(n)} for c, s, n in objects],
    }
    if relation is not None:
        meta["relation"] = {"type": relation, "a": 0, "b": 1}
    meta["prompt"] = caption(meta)
    return meta


def _enumerate(category: str) -> list[dict]:
    """Every prompt of one category, in a fixed order."""
    pairs = [(c, s) for s in SHAPE_NAMES for c in COLORS]
    if category in ("single_object", "colors"):
        return [make_meta(category, [(c, s, 1)]) for c, s in pairs]
    if category == "counting":
        return [make_meta(category, [(c, s, n)]) for n in NUMBERS for c, s in pairs]
    out = []
    for (c0, s0), (c1, s1) in itertools.permutations(pairs, 2):
        if s0 == s1 or (category != "two_object" and c0 == c1):
            continue  # two_object: distinct shapes; color_attr, position: distinct shapes and colours
        if category == "position":
            out += [make_meta(category, [(c0, s0, 1), (c1, s1, 1)], r) for r in RELATIONS]
        else:
            out.append(make_meta(category, [(c0, s0, 1), (c1, s1, 1)]))
    return out


def all_prompts() -> list[dict]:
    """The full deterministic enumeration of the template space, category by category."""
    return [m for cat in CATEGORIES for m in _enumerate(cat)]


def combination_key(meta: dict) -> str:
    """The combination a prompt tests, ignoring word order and relation: ``"red circle"`` for one
    object, ``"3 red circle"`` for counting, the sorted ``"blue square|red circle"`` for pairs."""
    objs = meta["objects"]
    if meta["category"] == "counting":
        return f"{objs[0]['count']} {objs[0]['color']} {objs[0]['shape']}"
    return "|".join(sorted(f"{o['color']} {o['shape']}" for o in objs))


def _hash(category: str, key: str) -> str:
    # single_object and colors share one namespace, so a held-out object is held out in both.
    salt = "object" if category in ("single_object", "colors") else category
    return hashlib.sha256(f"shapeeval/{salt}/{key}".encode()).hexdigest()


def held_out_keys(category: str) -> set[str]:
    """The ``HOLDOUT[category]`` combination keys with the smallest sha256 hash: the test keys."""
    keys = sorted({combination_key(m) for m in _enumerate(category)}, key=lambda k: _hash(category, k))
    return set(keys[: HOLDOUT[category]])


def split_of(meta: dict) -> str:
    """``"confirm"`` for a pair of the confirmation set's grammar (:func:`extends_grammar`), else
    ``"test"`` iff the prompt's combination key is held out for its category, else ``"train"``."""
    if extends_grammar(meta):
        return "confirm"
    return "test" if combination_key(meta) in held_out_keys(meta["category"]) else "train"


def make_splits() -> dict[str, list[dict]]:
    """Deterministic ``{"train": [...], "test": [...]}`` partition of :func:`all_prompts`."""
    held = {cat: held_out_keys(cat) for cat in CATEGORIES}
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for m in all_prompts():
        out["test" if combination_key(m) in held[m["category"]] else "train"].append(m)
    return out


CONFIRM_CATEGORIES = ("two_object", "color_attr", "position")
"""The categories with prompts outside :func:`all_prompts` (the other three are used up by it)."""


def extends_grammar(meta: dict) -> bool:
    """A pair of the confirmation set's grammar, which :func:`all_prompts` leaves out: the same shape in
    two colours (``two_object``, ``position``) or the same colour on two shapes (``color_attr``,
    ``position``). ``color_attr`` with the same shape twice is in neither grammar: the reward's
    shape-level credit wants each named shape once in any colour, so a scene that is exactly such a
    prompt scores 0 strict (``tests/test_shapes_confirm.py``)."""
    category = meta["category"]
    if category not in CONFIRM_CATEGORIES:
        return False
    (a, b) = meta["objects"]
    same_shape, same_color = a["shape"] == b["shape"], a["color"] == b["color"]
    if category == "two_object":
        return same_shape and not same_color
    if category == "color_attr":
        return same_color and not same_shape
    return same_shape != same_color  # one of the two; both would be one object twice


def confirmation_prompts() -> list[dict]:
    """The confirmation set (issue 56): a second held-out set that overlaps neither split, since the
    splits use up :func:`all_prompts`. ShapeEval's grammar extended within its vocabulary and categories
    (:func:`extends_grammar`), in a fixed order: ``two_object`` with the same shape in two colours (36),
    ``color_attr`` with the same colour on two shapes (24) and ``position`` with either, × its four
    relations (144 + 96): 300 prompts."""
    pairs = [(c, s) for s in SHAPE_NAMES for c in COLORS]
    out = []
    for category in CONFIRM_CATEGORIES:
        for (c0, s0), (c1, s1) in itertools.permutations(pairs, 2):
            relations = RELATIONS if category == "position" else [None]
            metas = [make_meta(category, [(c0, s0, 1), (c1, s1, 1)], r) for r in relations]
            out += [m for m in metas if extends_grammar(m)]
    return out


def _vocab() -> tuple[str, ...]:
    words = {w for m in all_prompts() for w in m["prompt"].split(" ")}
    return tuple(sorted(words))


VOCAB: tuple[str, ...] = _vocab()
"""Sorted tuple of every word that can occur in a caption."""


class _Malformed(Exception):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise _Malformed(msg)


def validate_meta(meta: object, prompt: str | None = None) -> None:
    """Raises ValueError naming the prompt unless ``meta`` is well-formed ShapeEval metadata whose
    ``"prompt"`` is the caption of its structure and, if ``prompt`` is given, equals ``prompt``."""
    if prompt is None:
        prompt = meta.get("prompt") if isinstance(meta, dict) else None
    try:
        _require(isinstance(meta, dict), f"metadata is {type(meta).__name__}, not a dict")
        cat = meta["category"]
        _require(cat in CATEGORIES, f"unknown category {cat!r}")
        objs = meta["objects"]
        n_objs = 1 if cat in ("single_object", "colors", "counting") else 2
        _require(isinstance(objs, list) and len(objs) == n_objs, f"{cat} needs a list of {n_objs} object(s)")
        for o in objs:
            _require(o["shape"] in SHAPES and o["color"] in PALETTE, f"unknown shape or colour in {o}")
            _require(type(o["count"]) is int and o["count"] in NUMBERS, f"bad count in {o}")
            _require(cat == "counting" or o["count"] == 1, f"{cat} needs count 1 in {o}")
        if cat == "position":
            rel = meta["relation"]
            _require(rel["type"] in RELATIONS and (rel["a"], rel["b"]) == (0, 1), f"bad relation {rel}")
        else:
            _require(meta.get("relation") is None, f"{cat} takes no relation")
        expected = caption(meta)
        _require(expected == meta["prompt"], f"its structure describes {expected!r}, not {meta['prompt']!r}")
        _require(expected == prompt, f"metadata is for {expected!r}")
    except KeyError as e:
        raise ValueError(f"prompt {prompt!r}: malformed ShapeEval metadata: missing key {e}") from None
    except (_Malformed, TypeError, IndexError, AttributeError) as e:
        raise ValueError(f"prompt {prompt!r}: malformed ShapeEval metadata: {e}") from None


def write_jsonl(path: str | Path, metas: list[dict]) -> None:
    """Writes one JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for m in metas:
            f.write(json.dumps(m) + "\n")


def read_jsonl(path: str | Path) -> list[dict]:
    """Reads one JSON object per non-empty line."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_prompts(split: str) -> list[dict]:
    """The shipped prompts of ``split`` ("train", "test" or "confirm": :data:`SETS`), read from
    ``flowcredit/tasks/data``."""
    if split not in SETS:
        raise ValueError(f"unknown ShapeEval split {split!r}; choices: {SETS}")
    ref = resources.files("flowcredit.tasks").joinpath("data").joinpath(f"shapes_{split}.jsonl")
    return [json.loads(line) for line in ref.read_text(encoding="utf-8").splitlines() if line.strip()]


def random_batch(
    rng: np.random.Generator, n: int, size: int = 32, prompts: list[dict] | None = None
) -> tuple[np.ndarray, list[dict]]:
    """Draws ``n`` prompts and renders one random image of each (the pretraining data generator).

    Without ``prompts``, a category is drawn uniformly, then a prompt uniformly within it, from the
    whole template space (train and test alike); with ``prompts``, uniformly from that list.
    Returns ``images`` (n, 3, size, size) float32 in [0, 1] and the list of ``n`` metadata dicts.
    """
    if prompts is None:
        cats = rng.integers(len(CATEGORIES), size=n)
        metas = [copy.deepcopy(_pick(_BY_CATEGORY[CATEGORIES[c]], rng)) for c in cats]
    else:
        metas = [prompts[i] for i in rng.integers(len(prompts), size=n)]
    images = np.empty((n, 3, size, size), dtype=np.float32)
    for i, meta in enumerate(metas):
        images[i] = render_scene(sample_scene(meta, rng, size), size).transpose(2, 0, 1)
    return images, metas


def _pick(metas: list[dict], rng: np.random.Generator) -> dict:
    return metas[int(rng.integers(len(metas)))]


_BY_CATEGORY = {cat: _enumerate(cat) for cat in CATEGORIES}


def main(argv: list[str] | None = None) -> None:
    """Regenerates ``shapes_train.jsonl``, ``shapes_test.jsonl`` and ``shapes_confirm.jsonl`` (default:
    the package data dir)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "data")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, metas in (make_splits() | {"confirm": confirmation_prompts()}).items():
        write_jsonl(args.out / f"shapes_{split}.jsonl", metas)
        print(f"{split}: {len(metas)} prompts -> {args.out / f'shapes_{split}.jsonl'}")


if __name__ == "__main__":
    main()
