"""ShapeEval generator, prompts and split: tests/test_shapes_task.py."""

import json
import re
from collections import Counter

import numpy as np
import pytest

from flowcredit.tasks.shapes import prompts as P
from flowcredit.tasks.shapes import scene as S


def _segment_residual(img: np.ndarray) -> np.ndarray:
    """Distance (H, W) of each pixel of a float image (H, W, 3) to the nearest bg -> colour segment."""
    x = img - S.BACKGROUND
    best = np.full(img.shape[:2], np.inf)
    for c in S.PALETTE.values():
        d = c - S.BACKGROUND
        a = np.clip(x @ d / (d @ d), 0, 1)
        best = np.minimum(best, np.linalg.norm(x - a[..., None] * d, axis=-1))
    return best


def test_enumeration_sizes_and_unique_prompts():
    metas = P.all_prompts()
    counts = Counter(m["category"] for m in metas)
    assert counts == {
        "single_object": 12,
        "colors": 12,
        "counting": 48,
        "two_object": 96,
        "color_attr": 72,
        "position": 288,
    }
    assert len({m["prompt"] for m in metas}) == len(metas)


def test_captions_are_clean_and_covered_by_vocab():
    assert list(P.VOCAB) == sorted(set(P.VOCAB))
    for m in P.all_prompts():
        assert re.fullmatch(r"[a-z]+( [a-z]+)*", m["prompt"]), m["prompt"]
        assert set(m["prompt"].split(" ")) <= set(P.VOCAB)
        assert json.loads(json.dumps(m)) == m
        P.validate_meta(m)  # the caption is a function of the structure
    assert "circles" in P.VOCAB and "four" in P.VOCAB and "left" in P.VOCAB


def test_caption_examples():
    assert P.make_meta("counting", [("green", "triangle", 3)])["prompt"] == "three green triangles"
    assert P.make_meta("counting", [("green", "triangle", 1)])["prompt"] == "one green triangle"
    pos = P.make_meta("position", [("red", "circle", 1), ("blue", "square", 1)], "left_of")
    assert pos["prompt"] == "a red circle to the left of a blue square"
    assert pos["relation"] == {"type": "left_of", "a": 0, "b": 1}
    attr = P.make_meta("color_attr", [("red", "square", 1), ("blue", "circle", 1)])
    assert attr["prompt"] == "a square that is red and a circle that is blue"


def test_split_is_deterministic_disjoint_and_shipped():
    splits = P.make_splits()
    assert splits == P.make_splits()
    assert {s: len(v) for s, v in splits.items()} == {"train": 442, "test": 86}
    for split in P.SPLITS:
        assert P.load_prompts(split) == splits[split]  # shipped files match the generator
    train, test = splits["train"], splits["test"]
    assert not {m["prompt"] for m in train} & {m["prompt"] for m in test}
    for cat in P.CATEGORIES:
        # the documented rule: a test combination never occurs in train within its category
        train_keys = {P.combination_key(m) for m in train if m["category"] == cat}
        test_keys = {P.combination_key(m) for m in test if m["category"] == cat}
        assert test_keys and not train_keys & test_keys, cat
        assert test_keys == P.held_out_keys(cat)
    assert all(P.split_of(m) == "test" for m in test) and all(P.split_of(m) == "train" for m in train)
    # single_object and colors hold out the same objects
    assert P.held_out_keys("single_object") == P.held_out_keys("colors")


def test_main_regenerates_shipped_files(tmp_path):
    P.main(["--out", str(tmp_path)])
    for split in P.SPLITS:
        assert P.read_jsonl(tmp_path / f"shapes_{split}.jsonl") == P.load_prompts(split)


def test_load_prompts_unknown_split():
    with pytest.raises(ValueError, match=r"'val'.*train.*test"):
        P.load_prompts("val")


@pytest.mark.parametrize(
    "meta",
    [
        {"category": "single_object", "objects": [{"shape": "circle", "color": "red", "count": 1}]},
        {"prompt": "a red circle", "category": "nope", "objects": []},
        {"prompt": "a red circle", "category": "single_object", "objects": [{"shape": "circle"}]},
        {
            "prompt": "a red circle",
            "category": "single_object",
            "objects": [{"shape": "circle", "color": "blue", "count": 1}],
        },
        {
            "prompt": "two red circles",
            "category": "counting",
            "objects": [{"shape": "circle", "color": "red", "count": 5}],
        },
        "a red circle",
    ],
)
def test_validate_meta_rejects_malformed(meta):
    with pytest.raises(ValueError, match="prompt"):
        P.validate_meta(meta)


def _check_scene(meta, placed, size):
    want = Counter((o["color"], o["shape"]) for o in meta["objects"] for _ in range(o["count"]))
    assert Counter((p.color, p.shape) for p in placed) == want
    gap = S.GAP * size / S.REFERENCE_SIZE
    boxes = [
        (p.cx - p.extent / 2, p.cy - p.extent / 2, p.cx + p.extent / 2, p.cy + p.extent / 2) for p in placed
    ]
    for b in boxes:
        assert b[0] >= 0 and b[1] >= 0 and b[2] <= size and b[3] <= size
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            separated = max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3])
            assert separated >= gap - 1e-9, meta["prompt"]
    if "relation" in meta:
        rel = meta["relation"]
        a, b = placed[rel["a"]], placed[rel["b"]]
        assert S.relation_holds(rel["type"], (a.cx, a.cy), (b.cx, b.cy), S.GENERATOR_SLACK)


@pytest.mark.parametrize("size", [32, 48])
def test_scenes_match_metadata_without_overlap(size):
    rng = np.random.default_rng(1)
    metas = P.all_prompts()
    for i in rng.choice(len(metas), 300, replace=False):
        _check_scene(metas[i], S.sample_scene(metas[i], rng, size), size)
    for n in P.NUMBERS:  # the densest scenes
        meta = P.make_meta("counting", [("blue", "square", n)])
        _check_scene(meta, S.sample_scene(meta, rng, size), size)


def test_render_prompt_colours_and_determinism():
    meta = P.make_meta("two_object", [("yellow", "circle", 1), ("green", "triangle", 1)])
    img = S.render_prompt(meta, np.random.default_rng(7))
    assert img.shape == (32, 32, 3) and img.dtype == np.uint8
    assert np.array_equal(img, S.render_prompt(meta, np.random.default_rng(7)))
    assert not np.array_equal(img, S.render_prompt(meta, np.random.default_rng(8)))
    f = img.astype(np.float32) / 255
    assert _segment_residual(f).max() < 0.01  # every pixel mixes the background with one palette colour
    for color in ("yellow", "green"):  # both colours appear fully covered somewhere
        assert (np.abs(f - S.PALETTE[color]).max(-1) < 0.01).any()
    assert (np.abs(f - S.BACKGROUND).max(-1) < 0.01).mean() > 0.5
    assert S.render_prompt(meta, np.random.default_rng(0), size=48).shape == (48, 48, 3)
    S.render_prompt(P.make_meta("counting", [("red", "circle", 4)]), np.random.default_rng(0), gap=None)


def test_random_batch():
    x, metas = P.random_batch(np.random.default_rng(3), 16)
    x2, metas2 = P.random_batch(np.random.default_rng(3), 16)
    assert x.shape == (16, 3, 32, 32) and x.dtype == np.float32 and len(metas) == 16
    assert np.array_equal(x, x2) and metas == metas2
    assert x.min() >= 0 and x.max() <= 1
    test = P.load_prompts("test")
    x, metas = P.random_batch(np.random.default_rng(3), 8, size=40, prompts=test)
    assert x.shape == (8, 3, 40, 40) and all(m in test for m in metas)
