"""The confirmation set (issue 56): ShapeEval's grammar extended to the pairs the splits do not hold,
disjoint from train and test, valid, and scored right by the reward: tests/test_shapes_confirm.py."""

from collections import Counter

import numpy as np
import pytest

from flowcredit.tasks.prompt_sets import read_prompts
from flowcredit.tasks.shapes import prompts as P
from flowcredit.tasks.shapes import reward as R
from flowcredit.tasks.shapes import scene as S

CONFIRM = P.confirmation_prompts()


def _render(metas, seed, keep=None):
    """One scene of each prompt (``keep``: only the first ``keep`` objects of it), (B, 3, 32, 32)."""
    rng = np.random.default_rng(seed)
    scenes = [S.sample_scene(m, rng, 32)[:keep] for m in metas]
    return np.stack([S.render_scene(s, 32).transpose(2, 0, 1) for s in scenes])


def test_size_per_category_and_shipped():
    assert Counter(m["category"] for m in CONFIRM) == {"two_object": 36, "color_attr": 24, "position": 240}
    assert len({m["prompt"] for m in CONFIRM}) == len(CONFIRM) == 300
    assert P.confirmation_prompts() == CONFIRM  # deterministic
    assert P.load_prompts("confirm") == CONFIRM  # the shipped file is the generator's
    assert read_prompts("confirm", shapes_metadata=True) == CONFIRM  # the split name reads it everywhere


def test_main_regenerates_the_shipped_set(tmp_path):
    P.main(["--out", str(tmp_path)])
    assert P.read_jsonl(tmp_path / "shapes_confirm.jsonl") == P.load_prompts("confirm")


def test_it_overlaps_neither_train_nor_test():
    splits = P.make_splits()
    assert {len(v) for v in splits.values()} == {442, 86}
    seen = {m["prompt"] for m in P.all_prompts()}
    assert not seen & {m["prompt"] for m in CONFIRM}
    for split in ("train", "test"):
        keys = {(m["category"], P.combination_key(m)) for m in P.load_prompts(split)}
        assert not keys & {(m["category"], P.combination_key(m)) for m in CONFIRM}, split
    assert {P.split_of(m) for m in CONFIRM} == {"confirm"}
    assert {P.split_of(m) for m in splits["test"]} == {"test"}


def test_every_prompt_validates_within_the_vocabulary():
    for m in CONFIRM:
        P.validate_meta(m)
        assert set(m["prompt"].split(" ")) <= set(P.VOCAB), m["prompt"]
        (a, b) = m["objects"]
        assert (a["shape"] == b["shape"]) != (a["color"] == b["color"]), m["prompt"]
    two = [m for m in CONFIRM if m["category"] != "position"]
    assert all(m["objects"][0]["shape"] == m["objects"][1]["shape"] for m in two[:36])  # two_object
    assert all(m["objects"][0]["color"] == m["objects"][1]["color"] for m in two[36:])  # color_attr


@pytest.mark.parametrize("seed", [0, 1])
def test_the_reward_passes_the_scene_of_each_prompt_and_fails_it_without_an_object(seed):
    assert R.score_images(_render(CONFIRM, seed), CONFIRM)["strict"].min() == 1
    missing = R.score_images(_render(CONFIRM, seed, keep=1), CONFIRM)
    assert missing["strict"].max() == 0 and missing["soft"].max() < 1


def test_the_reward_fails_a_flipped_relation_and_a_wrong_colour():
    flip = {"left_of": "right_of", "right_of": "left_of", "above": "below", "below": "above"}
    position = [m for m in CONFIRM if m["category"] == "position"]
    x = _render(position, 2)
    flipped = [
        P.make_meta("position", [(o["color"], o["shape"], 1) for o in m["objects"]], flip[r])
        for m in position
        for r in [m["relation"]["type"]]
    ]
    assert R.score_images(x, flipped)["strict"].max() == 0
    # "a red circle and a blue circle" drawn as two red circles: the blue one is missing
    two = [m for m in CONFIRM if m["category"] == "two_object"]
    recoloured = [
        P.make_meta("two_object", [(m["objects"][0]["color"], m["objects"][0]["shape"], 1)] * 2) for m in two
    ]
    assert R.score_images(_render(recoloured, 3), two)["strict"].max() == 0


def test_the_left_out_color_attr_pairs_the_reward_cannot_score():
    """``color_attr`` with the same shape in two colours is out of the set: its shape-level credit wants
    each shape once in any colour, so the exact scene scores 0 (if the reward learns to score it, the
    set can take these 36 prompts)."""
    left_out = [
        P.make_meta("color_attr", [(c0, s, 1), (c1, s, 1)])
        for s in P.SHAPE_NAMES
        for c0 in P.COLORS
        for c1 in P.COLORS
        if c0 != c1
    ]
    assert len(left_out) == 36 and not any(P.extends_grammar(m) for m in left_out)
    assert R.score_images(_render(left_out, 0), left_out)["strict"].max() == 0
