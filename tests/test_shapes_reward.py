"""ShapeEval reward: the quality bar and hand-made cases: tests/test_shapes_reward.py."""

import copy

import numpy as np
import pytest
from scipy import ndimage

from flowcredit.tasks.shapes import prompts as P
from flowcredit.tasks.shapes import reward as R
from flowcredit.tasks.shapes import scene as S


@pytest.fixture(scope="module")
def batch():
    """1,000 generator images of their own captions, all categories, fixed seed."""
    return P.random_batch(np.random.default_rng(0), 1000)


def _render(metas, seed=0, size=32):
    rng = np.random.default_rng(seed)
    return np.stack([S.render_scene(S.sample_scene(m, rng, size), size).transpose(2, 0, 1) for m in metas])


def _of(category):
    return [m for m in P.all_prompts() if m["category"] == category]


def test_generator_images_score_strict(batch):
    x, metas = batch
    r = R.score_images(x, metas)
    assert r["strict"].mean() >= 0.98
    table = R.evaluation_table(r["soft"], r["strict"], r["category"])
    assert set(table) == {*P.CATEGORIES, "overall"}
    assert all(row["strict"] >= 0.95 for row in table.values()), R.format_table(table)


def test_noise_and_blank_score_near_zero(batch):
    x, metas = batch
    noise = np.random.default_rng(1).random(x.shape, dtype=np.float32)
    assert R.score_images(noise, metas)["soft"].mean() <= 0.05
    blank = np.broadcast_to(S.BACKGROUND[None, :, None, None], x.shape)
    assert R.score_images(blank, metas)["soft"].mean() <= 0.05


def test_robust_to_colour_noise_and_blur(batch):
    x, metas = batch[0][:400], batch[1][:400]
    noisy = np.clip(x + np.random.default_rng(2).normal(0, 0.03, x.shape), 0, 1)
    assert R.score_images(noisy, metas)["strict"].mean() >= 0.95
    blurred = ndimage.gaussian_filter(x, (0, 0, 0.7, 0.7))
    assert R.score_images(blurred, metas)["strict"].mean() >= 0.95
    uint8 = np.round(x * 255) / 255
    assert R.score_images(uint8, metas)["strict"].mean() >= 0.98


def test_wrong_object_scores_low():
    singles = _of("single_object")
    x = _render(singles * 2)
    other = [singles[(i + 5) % 12] for i in range(12)]  # a different (colour, shape) each time
    r = R.score_images(x[:12], other)
    assert r["strict"].max() == 0 and r["soft"].max() == 0
    assert R.score_images(x[12:], singles)["strict"].min() == 1


def test_position_flips_are_detected():
    flip = {"left_of": "right_of", "right_of": "left_of", "above": "below", "below": "above"}
    metas = _of("position")[::3]
    x = _render(metas)
    assert R.score_images(x, metas)["strict"].mean() >= 0.98
    flipped = []
    for m in metas:
        objs = [(o["color"], o["shape"], 1) for o in m["objects"]]
        flipped.append(P.make_meta("position", objs, flip[m["relation"]["type"]]))
    r = R.score_images(x, flipped)
    assert r["strict"].max() == 0 and r["soft"].max() <= 0.75


def test_counting_off_by_one_is_detected():
    metas = _of("counting")
    x = _render(metas)
    for delta in (-1, 1):
        ok = [i for i, m in enumerate(metas) if 1 <= m["objects"][0]["count"] + delta <= 4]
        wrong = []
        for i in ok:
            o = metas[i]["objects"][0]
            wrong.append(P.make_meta("counting", [(o["color"], o["shape"], o["count"] + delta)]))
        r = R.score_images(x[ok], wrong)
        assert r["strict"].max() == 0 and r["soft"].max() < 1


def test_colour_binding_swap_is_detected():
    metas = _of("color_attr")[:24]
    swapped = []
    for m in metas:
        (a, b) = m["objects"]
        swapped.append(P.make_meta("color_attr", [(b["color"], a["shape"], 1), (a["color"], b["shape"], 1)]))
    r = R.score_images(_render(swapped), metas)
    assert r["strict"].max() == 0 and r["soft"].max() <= 0.5


def test_hand_made_scenes():
    red_circle = P.make_meta("single_object", [("red", "circle", 1)])
    circle = S.Placed("circle", "red", 10.0, 12.0, 10.0)
    extra = S.Placed("triangle", "yellow", 24.0, 22.0, 9.0)
    x = np.stack([S.render_scene(s).transpose(2, 0, 1) for s in ([circle], [circle, extra])])
    det = R.detect_objects(x)
    assert [(d["color"], d["shape"]) for d in det[1]] == [("red", "circle"), ("yellow", "triangle")]
    assert abs(det[0][0]["cx"] - 10.0) < 0.3 and abs(det[0][0]["cy"] - 12.0) < 0.3
    r = R.score_images(x, [red_circle, red_circle])
    assert r["strict"].tolist() == [1, 0] and r["soft"][1] == pytest.approx(0.75)  # (1 + 1/2) / 2
    colors = P.make_meta("colors", [("blue", "circle", 1)])  # right shape, wrong colour
    assert R.score_images(x[:1], [colors])["soft"][0] == pytest.approx(0.5)  # (1 + 0 + 1/2) / 3
    canvas = np.broadcast_to(S.PALETTE["red"][None, :, None, None], (1, 3, 32, 32))
    assert R.score_images(canvas, [P.make_meta("single_object", [("red", "square", 1)])])["soft"][0] == 0


def test_shapes_reward_interface():
    import torch

    metas = copy.deepcopy(_of("two_object")[:4])
    x = torch.from_numpy(_render(metas))
    prompts = [m["prompt"] for m in metas]
    out = R.shapes_reward(x, prompts, metas)
    assert out.dtype == torch.float32 and out.shape == (4,)
    assert torch.equal(out, torch.as_tensor(R.score_images(x, metas)["soft"], dtype=torch.float32))
    with pytest.raises(ValueError, match="a red circle"):
        R.shapes_reward(x[:1], ["a red circle"], [None])
    with pytest.raises(ValueError, match="a red circle"):
        R.shapes_reward(x[:1], ["a red circle"], [metas[0]])  # metadata of another prompt
    bad = dict(metas[0], objects=[{"shape": "hexagon", "color": "red", "count": 1}] * 2)
    with pytest.raises(ValueError, match=prompts[0]):
        R.shapes_reward(x[:1], prompts[:1], [bad])
    with pytest.raises(ValueError, match=prompts[0]):
        R.shapes_reward(x[:1], prompts[:1], ["not a dict"])
    with pytest.raises(ValueError):
        R.shapes_reward(x[:2], prompts[:2], metas[:1])


def test_shapes_strict_reward_is_the_pass_fail_and_fails_a_surplus_object():
    import torch

    from flowcredit.rewards import get_reward, uses_shapeeval

    meta = copy.deepcopy(_of("single_object")[0])  # "a <colour> <shape>"
    twice = dict(meta, objects=[dict(meta["objects"][0], count=2)])  # the same object drawn twice
    x = torch.from_numpy(np.concatenate([_render([meta]), _render([twice], seed=3)]))
    prompts = [meta["prompt"]] * 2
    strict = R.shapes_strict_reward(x, prompts, [meta, meta])
    soft = R.shapes_reward(x, prompts, [meta, meta])
    assert strict.tolist() == [1.0, 0.0]  # a surplus object fails the image outright ...
    assert soft[0] == 1.0 and 0.5 < soft[1] < 1.0  # ... where the soft score only loses a part
    mix = get_reward("shapes=0.5,shapes_strict=0.5")(x, prompts, [meta, meta])
    assert torch.allclose(mix, 0.5 * soft + 0.5 * strict)
    with pytest.raises(ValueError, match=meta["prompt"]):
        R.shapes_strict_reward(x[:1], prompts[:1], [None])
    assert uses_shapeeval("shapes_strict") and uses_shapeeval("jpeg_compressibility=1,shapes=0.5")
    assert not uses_shapeeval("jpeg_compressibility")


def test_evaluation_table_and_format():
    table = R.evaluation_table([1.0, 0.0, 0.5], [1.0, 0.0, 0.0], ["position", "counting", "position"])
    assert list(table) == ["counting", "position", "overall"]
    assert table["position"] == {"soft": 0.75, "strict": 0.5, "n": 2}
    assert table["overall"] == {"soft": 0.375, "strict": 0.25, "n": 3}  # mean over categories
    text = R.format_table(table)
    lines = text.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1
    assert lines[-1].split() == ["overall", "3", "0.375", "0.250"]
