"""GenEval's rules on hand-built detections (flowcredit/tasks/geneval/rules.py), its metadata checks,
and the rule engine over ShapeEval's exact parse against the ``shapes`` rewards."""

import itertools

import numpy as np
import pytest
import torch

from flowcredit.errors import UserError
from flowcredit.tasks.geneval.metadata import COCO_CLASSES, from_shapeeval, validate
from flowcredit.tasks.geneval.rules import Found, check, relations, visible


def box(cx, cy, w=10.0, h=10.0):
    return (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)


def obj(cx=50.0, cy=50.0, score=0.95, color=None, w=10.0, h=10.0):
    return Found(box=box(cx, cy, w, h), score=score, color=color)


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ((20, 50), (80, 50), {"left of"}),
        ((80, 50), (20, 50), {"right of"}),
        ((50, 20), (50, 80), {"above"}),  # y grows downwards
        ((50, 80), (50, 20), {"below"}),
        ((20, 20), (80, 80), {"left of", "above"}),  # 45°: dx = dy = −0.707 < −½ on both axes
        ((51, 50), (50, 50), set()),  # offset 1 < margin 0.1 · (10 + 10) = 2 on x: nothing left
    ],
)
def test_relations_by_hand(a, b, expected):
    assert relations(box(*a), box(*b)) == expected


def test_relations_margin_shrinks_towards_zero():
    # offset (30, 10), sizes 10 + 10: shrunk (30 − 2, 10 − 2) = (28, 8), |offset| = √1000 = 31.62
    # dx = 28 / 31.62 = 0.885 > ½ → right of; dy = 8 / 31.62 = 0.253 → neither above nor below
    assert relations(box(80, 60), box(50, 50)) == {"right of"}
    # offset (6, 0) with sizes 40 + 40: 6 − 8 < 0 → 0: no relation although a is to the right
    assert relations(box(56, 50, 40, 40), box(50, 50, 40, 40)) == set()


def test_visible_thresholds_order_and_cap():
    scene = {"cup": [obj(score=s) for s in (0.2, 0.5, 0.95, 0.31, 0.3)]}
    assert [f.score for f in visible(scene, "colors")["cup"]] == [0.95, 0.5, 0.31]  # > 0.3, highest first
    assert [f.score for f in visible(scene, "counting")["cup"]] == [0.95]  # > 0.9 for counting
    many = {"cup": [obj(score=0.5 + i / 100) for i in range(20)]}
    assert len(visible(many, "single_object")["cup"]) == 16


def meta(tag, include, exclude=None):
    m = {"tag": tag, "prompt": "p", "include": include}
    return m | ({"exclude": exclude} if exclude else {})


def test_single_and_two_object():
    m = meta("two_object", [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}])
    v = check({"cat": [obj()], "dog": [obj()]}, m)
    assert v.strict and v.partial == 1.0
    v = check({"cat": [obj()]}, m)
    assert not v.strict and v.credits == [1.0, 0.0] and v.partial == 0.5
    # an extra object of another class is allowed (GenEval names no "nothing else" rule)
    assert check({"cat": [obj()], "dog": [obj()], "car": [obj(), obj()]}, m).strict
    # below the threshold it is not there
    assert check({"cat": [obj()], "dog": [obj(score=0.3)]}, m).credits == [1.0, 0.0]


def test_counting_include_and_exclude():
    m = meta("counting", [{"class": "apple", "count": 3}], [{"class": "apple", "count": 4}])
    assert check({"apple": [obj()] * 3}, m).strict
    v = check({"apple": [obj()] * 2}, m)
    assert v.credits == [2 / 3, 1.0] and not v.strict
    v = check({"apple": [obj()] * 4}, m)
    assert v.credits == [1.0, 0.0] and not v.strict  # too many: the exclude fails
    # counting uses 0.9: a 0.8 apple does not count, so three found become two
    assert check({"apple": [obj(), obj(), obj(score=0.8)]}, m).credits == [2 / 3, 1.0]
    # zero found of an excluded class passes the exclude
    v = check({}, m)
    assert v.credits == [0.0, 1.0] and v.partial == 0.5


def test_colors_and_color_attr():
    m = meta("colors", [{"class": "cup", "count": 1, "color": "purple"}])
    assert check({"cup": [obj(color="purple")]}, m).strict
    v = check({"cup": [obj(color="red")]}, m)
    assert v.credits == [1.0, 0.0] and not v.strict
    # the group is the highest-scored `count` objects: a purple cup ranked second does not help
    v = check({"cup": [obj(score=0.99, color="red"), obj(score=0.5, color="purple")]}, m)
    assert not v.strict
    m2 = meta(
        "color_attr",
        [{"class": "kite", "count": 1, "color": "orange"}, {"class": "boat", "count": 1, "color": "blue"}],
    )
    v = check({"kite": [obj(color="orange")], "boat": [obj(color="red")]}, m2)
    assert v.credits == [1.0, 1.0, 1.0, 0.0] and v.partial == 0.75
    # colours come from the detector's classifier when it does not set them
    calls = []

    def colors(name, group):
        calls.append((name, len(group)))
        return ["blue"] * len(group)

    assert check({"boat": [obj()], "kite": [obj()]}, m2, colors).credits == [1.0, 0.0, 1.0, 1.0]
    assert calls == [("kite", 1), ("boat", 1)]


def test_position():
    m = meta(
        "position", [{"class": "dog", "count": 1}, {"class": "bench", "count": 1, "position": ["left of", 0]}]
    )
    assert check({"dog": [obj(80, 50)], "bench": [obj(20, 50)]}, m).strict
    v = check({"dog": [obj(20, 50)], "bench": [obj(80, 50)]}, m)
    assert v.credits == [1.0, 1.0, 0.0] and not v.strict
    v = check({"bench": [obj(20, 50)]}, m)  # no target: position credit 0
    assert v.credits == [0.0, 1.0, 0.0]
    # a target group that failed its own colour is no target for the strict rule
    mc = meta(
        "position",
        [
            {"class": "dog", "count": 1, "color": "red"},
            {"class": "bench", "count": 1, "position": ["left of", 0]},
        ],
    )
    v = check({"dog": [obj(80, 50, color="blue")], "bench": [obj(20, 50)]}, mc)
    assert not v.strict and v.credits == [1.0, 0.0, 1.0, 0.0]


def test_strict_iff_partial_is_one():
    rng = np.random.default_rng(0)
    metas = [
        meta("counting", [{"class": "apple", "count": 2}], [{"class": "apple", "count": 3}]),
        meta(
            "position", [{"class": "dog", "count": 1}, {"class": "cat", "count": 1, "position": ["above", 0]}]
        ),
        meta(
            "color_attr",
            [{"class": "cat", "count": 1, "color": "red"}, {"class": "dog", "count": 1, "color": "blue"}],
        ),
    ]
    seen = set()
    for _, m in itertools.product(range(200), metas):
        scene = {
            name: [
                obj(*rng.uniform(0, 100, 2), rng.uniform(0, 1), rng.choice(["red", "blue"])) for _ in range(n)
            ]
            for name, n in zip(("apple", "dog", "cat"), rng.integers(0, 4, 3))
        }
        v = check(scene, m)
        assert v.strict == (v.partial == 1.0) and v.strict == (not v.reasons)
        seen.add(v.strict)
    assert seen == {True, False}


@pytest.mark.parametrize(
    "bad, culprit",
    [
        ({"tag": "colors", "prompt": "a red cup"}, "include"),
        (meta("colors", [{"class": "unicorn", "count": 1}]), "unicorn"),
        (meta("colors", [{"class": "cup", "count": 0}]), "count"),
        (meta("counting", [{"class": "cup", "count": 1}], [{"class": "cup", "count": 0}]), "exclude[0]"),
        (meta("colors", [{"class": "cup", "count": 1, "color": "teal"}]), "teal"),
        (meta("position", [{"class": "cup", "count": 1, "position": ["left of", 0]}]), "position"),
    ],
)
def test_bad_metadata_names_the_culprit(bad, culprit):
    with pytest.raises(ValueError, match="position|include|unicorn|count|teal") as info:
        validate(bad, COCO_CLASSES)
    assert culprit in str(info.value)


def _render(metas, seed=0):
    from flowcredit.tasks.shapes import render_prompt

    rng = np.random.default_rng(seed)
    imgs = np.stack([render_prompt(m, rng, size=32) for m in metas]).astype(np.float32) / 255
    return torch.from_numpy(imgs).permute(0, 3, 1, 2)


def test_shapeeval_renders_pass_geneval_and_shapes_strict_alike():
    from flowcredit.rewards import get_reward
    from flowcredit.tasks.shapes import load_prompts

    metas = load_prompts("test")
    images, prompts = _render(metas), [m["prompt"] for m in metas]
    reward = get_reward("geneval,shapes_strict", {"geneval": {"detector": "shapes", "score": "strict"}})
    reward(images, prompts, metas)
    g, s = reward.last_components["geneval"], reward.last_components["shapes_strict"]
    assert torch.equal(g, s) and g.min() == 1.0  # every render of a prompt passes both


def test_shapeeval_perturbations_where_the_rules_agree_and_where_they_differ():
    from flowcredit.tasks.geneval.reward import geneval
    from flowcredit.tasks.shapes import make_meta
    from flowcredit.tasks.shapes.reward import score_images

    two = make_meta("two_object", [("red", "circle", 1), ("blue", "square", 1)])
    cases = {  # image drawn for this metadata, scored against `two`: (geneval strict, shapes strict)
        "the prompt": (two, True, True),
        "an object missing": (make_meta("single_object", [("red", "circle", 1)]), False, False),
        "a wrong colour": (
            make_meta("two_object", [("red", "circle", 1), ("green", "square", 1)]),
            False,
            False,
        ),
        # the rules differ on purpose here: GenEval allows objects no requirement names, ShapeEval's
        # strict score fails any surplus object (docs/geneval.md)
        "an extra triangle": (
            make_meta("color_attr", [("red", "circle", 1), ("blue", "square", 1), ("yellow", "triangle", 1)]),
            True,
            False,
        ),
    }
    reward = geneval(detector="shapes", score="strict")
    for name, (drawn, want_geneval, want_shapes) in cases.items():
        image = _render([drawn], seed=3)
        assert reward(image, [two["prompt"]], [two]).item() == float(want_geneval), name
        assert score_images(image, [two])["strict"][0] == float(want_shapes), name


def test_from_shapeeval_position_and_counting():
    from flowcredit.tasks.shapes import make_meta

    pos = from_shapeeval(make_meta("position", [("red", "circle", 1), ("blue", "square", 1)], "left_of"))
    assert pos["include"] == [
        {"class": "square", "count": 1, "color": "blue"},
        {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]},
    ]
    cnt = from_shapeeval(make_meta("counting", [("red", "circle", 3)]))
    assert cnt["exclude"] == [{"class": "circle", "count": 4}]


def test_geneval_reward_rejects_metadata_it_cannot_score():
    from flowcredit.tasks.geneval.reward import geneval

    reward = geneval(detector="shapes")
    cup = meta("colors", [{"class": "cup", "count": 1, "color": "red"}])
    with pytest.raises(UserError, match="'p'.*unknown class 'cup'"):
        reward(torch.zeros(1, 3, 32, 32), ["p"], [cup])
    with pytest.raises(UserError, match="prompts.jsonl: line 2: .*include"):
        reward.check_metadata(
            [cup | {"include": [{"class": "circle", "count": 1}]}, {"prompt": "q"}], "prompts.jsonl"
        )
    with pytest.raises(UserError, match="detector"):
        geneval(detector="yolo")


def test_metadata_errors_name_the_prompt_once_and_list_the_classes():
    from flowcredit.tasks.geneval.reward import geneval

    reward = geneval(detector="shapes")
    cup = meta("colors", [{"class": "cup", "count": 1, "color": "red"}])
    with pytest.raises(UserError) as info:
        reward(torch.zeros(1, 3, 32, 32), ["a red cup"], [cup])
    assert str(info.value) == (
        "geneval reward: prompt 'a red cup': include[0]: unknown class 'cup'; "
        "the detector's: circle, square, triangle"
    )
    with pytest.raises(UserError) as info:
        reward.check_metadata([{"prompt": "q", "tag": "colors"}], "prompts.jsonl")
    assert str(info.value) == (
        "prompts.jsonl: line 1: geneval reward: prompt 'q': GenEval metadata needs a non-empty 'include' list"
    )
    # an unknown COCO class: the message lists GenEval's 80 classes, in one line
    with pytest.raises(ValueError) as info:
        validate(meta("colors", [{"class": "unicorn", "count": 1}]), COCO_CLASSES)
    assert (
        str(info.value) == f"include[0]: unknown class 'unicorn'; the detector's: {', '.join(COCO_CLASSES)}"
    )
    assert len(COCO_CLASSES) == 80 and "traffic light, fire hydrant" in str(info.value)
