"""GenEval's order of equal scores (flowcredit/tasks/geneval/rules.py ``geneval_order``: of two equal
scores the later-listed detection ranks first, as ``np.argsort(scores)[::-1]`` in GenEval's
``evaluate_images.py``) and the ``shapes`` detector's listing order, which keeps ShapeEval's
GenEval-rule verdicts what they were before the rule engine followed that order (shapes_detector.py)."""

import itertools

import numpy as np
import pytest
import torch

from flowcredit.tasks.geneval import rules
from flowcredit.tasks.geneval.reward import SHAPE_CLASSES, geneval, geneval_metadata
from flowcredit.tasks.geneval.rules import Found, check, geneval_order, visible


def obj(cx, score, color=None, cy=50.0):
    return Found(box=(cx - 5, cy - 5, cx + 5, cy + 5), score=score, color=color)


def meta(tag, include):
    return {"tag": tag, "prompt": "p", "include": include}


def test_geneval_order_is_numpys_reversed_stable_argsort():
    """numpy 1.23 (GenEval's pin) sorts ≤ 16 elements stably; reversed, the later of equal scores leads."""
    rng = np.random.default_rng(0)
    for n in range(1, 17):
        for _ in range(20):
            scores = rng.integers(0, 3, n) / 4 + 0.25  # many ties
            found = [Found(box=(0, 0, 1, 1), score=float(s), index=i) for i, s in enumerate(scores)]
            expected = np.argsort(scores, kind="stable")[::-1].tolist()
            assert [f.index for f in geneval_order(found)] == expected
    a, b, c, d = (Found((0, 0, 1, 1), s, index=i) for i, s in enumerate((0.5, 0.9, 0.5, 0.9)))
    assert geneval_order([a, b, c, d]) == [d, b, c, a]  # by hand


def test_equal_scores_the_later_listed_detection_forms_the_group():
    purple = meta("colors", [{"class": "cup", "count": 1, "color": "purple"}])
    red_then_purple = {"cup": [obj(50, 0.8, "red"), obj(50, 0.8, "purple")]}
    assert [f.color for f in visible(red_then_purple, "colors")["cup"]] == ["purple", "red"]
    assert check(red_then_purple, purple).strict  # GenEval's order: the purple cup, listed later, leads
    purple_then_red = {"cup": red_then_purple["cup"][::-1]}
    assert not check(purple_then_red, purple).strict
    # a higher score still wins over the listing order
    assert not check({"cup": [obj(50, 0.81, "red"), obj(50, 0.8, "purple")]}, purple).strict
    # position: of two equal-scored benches, the later-listed one must be left of the dog
    left = meta(
        "position", [{"class": "dog", "count": 1}, {"class": "bench", "count": 1, "position": ["left of", 0]}]
    )
    dog = [obj(50, 0.9)]
    assert check({"dog": dog, "bench": [obj(80, 0.7), obj(20, 0.7)]}, left).strict
    assert not check({"dog": dog, "bench": [obj(20, 0.7), obj(80, 0.7)]}, left).strict


def _component_order_scenes(images) -> list[dict]:
    """The ``shapes`` detector's scenes as it listed them before: every class in component order."""
    from flowcredit.tasks.shapes.reward import BLOB, find_components
    from flowcredit.tasks.shapes.scene import PALETTE, SHAPES

    comps, colors, shapes = find_components(images), [*PALETTE, "unknown"], list(SHAPES)
    scenes = [{} for _ in range(images.shape[0])]
    for i in range(len(comps["image"])):
        s = int(comps["shape"][i])
        box = tuple(float(comps[k][i]) for k in ("x0", "y0", "x1", "y1"))
        found = Found(box=box, score=1.0, color=colors[int(comps["color"][i])], index=i)
        scenes[int(comps["image"][i])].setdefault("blob" if s == BLOB else shapes[s], []).append(found)
    return scenes


def _rendered_cases():
    """Scenes with two objects of one shape in different colours (the tie decides which one is the
    group), scored against a prompt naming one of them, plus ShapeEval's held-out prompts as drawn."""
    from flowcredit.tasks.shapes import load_prompts, make_meta, render_prompt

    drawn, scored = [], []
    for shape, (c0, c1) in itertools.product(
        SHAPE_CLASSES, itertools.permutations(["red", "green", "blue"], 2)
    ):
        pair = make_meta("two_object", [(c0, shape, 1), (c1, shape, 1)])
        drawn += [pair, pair]
        scored += [make_meta("colors", [(c, shape, 1)]) for c in (c0, c1)]
        other = "square" if shape != "square" else "circle"
        three = make_meta("color_attr", [(c0, shape, 1), (c1, shape, 1), ("yellow", other, 1)])
        for rel in ("left_of", "above"):
            drawn.append(three)
            scored.append(make_meta("position", [(c0, shape, 1), ("yellow", other, 1)], rel))
    held_out = load_prompts("test")
    drawn, scored = drawn + held_out, scored + held_out
    rng = np.random.default_rng(0)
    images = np.stack([render_prompt(m, rng, size=32) for m in drawn]).astype(np.float32) / 255
    return torch.from_numpy(images).permute(0, 3, 1, 2), scored


def test_shapes_detector_verdicts_are_unchanged_on_rendered_scenes(monkeypatch):
    images, scored = _rendered_cases()
    metas = geneval_metadata(scored, [m["prompt"] for m in scored], SHAPE_CLASSES, shapes=True)
    now = geneval(detector="shapes").verdicts(images, [m["prompt"] for m in scored], scored)
    old_scenes = _component_order_scenes(images)
    naive = [check(s, m) for s, m in zip(old_scenes, metas)]  # GenEval's order, old listing
    with monkeypatch.context() as mp:  # the rule before: highest first, of equal scores the earlier
        mp.setattr(rules, "geneval_order", lambda found: sorted(found, key=lambda f: -f.score))
        before = [check(s, m) for s, m in zip(old_scenes, metas)]
    assert [(v.strict, v.partial) for v in now] == [(v.strict, v.partial) for v in before]
    assert {v.strict for v in before} == {True, False}
    changed = sum((a.strict, a.partial) != (b.strict, b.partial) for a, b in zip(naive, before))
    assert changed > 0  # the cases are ones where the tie decides: the old listing would have flipped


@pytest.mark.parametrize("n", [2, 4])
def test_shapes_detector_lists_each_class_last_component_first(n):
    from flowcredit.tasks.geneval.shapes_detector import parse
    from flowcredit.tasks.shapes import make_meta, render_prompt

    image = render_prompt(make_meta("counting", [("red", "circle", n)]), np.random.default_rng(1), size=32)
    images = torch.from_numpy(image[None].astype(np.float32) / 255).permute(0, 3, 1, 2)
    listed = parse(images)[0]["circle"]
    assert [f.index for f in listed] == sorted((f.index for f in listed), reverse=True)
    assert [f.index for f in visible({"circle": listed}, "counting")["circle"]] == sorted(
        f.index for f in listed
    )
