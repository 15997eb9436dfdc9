"""GenEval's Mask2Former + CLIP detector (flowcredit/tasks/geneval/mask2former.py) on tiny random models
built here (no downloads): post-processing against hand computations, batching, dtypes, the masked crop,
the colour classifier against an independent computation, and the whole ``geneval`` reward path."""

import json

import pytest
import test_rewards_clip
import torch
import torch.nn.functional as F

from flowcredit.errors import UserError
from flowcredit.rewards import get_reward
from flowcredit.rewards.clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, load_clip
from flowcredit.tasks.geneval import mask2former as m2f
from flowcredit.tasks.geneval.metadata import COCO_CLASSES
from flowcredit.tasks.geneval.rules import COLORS

CUP, DOG = COCO_CLASSES.index("cup"), COCO_CLASSES.index("dog")
CLIP_WORDS = [*COLORS, "a", "photo", "of", "-", "colored", "object", "cup", "dog"]


def save_tiny_mask2former(path, labels=COCO_CLASSES, bias=((CUP, 8.0), (DOG, 7.0))):
    """A tiny random Mask2Former (Swin backbone) with ``labels``, the class head biased towards ``bias``
    (so that most queries are confident cups/dogs), saved with a preprocessor config into ``path``."""
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    swin = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=2,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    config = Mask2FormerConfig(
        backbone_config=swin,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        dim_feedforward=32,
        num_queries=6,
        id2label=dict(enumerate(labels)),
        label2id={name: i for i, name in enumerate(labels)},
    )
    torch.manual_seed(0)
    model = Mask2FormerForUniversalSegmentation(config).eval()
    with torch.no_grad():
        for label, value in bias:
            model.class_predictor.bias[label] += value
    model.save_pretrained(path)
    pre = {"size": {"shortest_edge": 64, "longest_edge": 96}, "size_divisor": 32, "resample": 2}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_mask2former(tmp_path_factory.mktemp("m2f"))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_rewards_clip, "WORDS", CLIP_WORDS)
        return test_rewards_clip.save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def detector(model_dir, clip_dir):
    return m2f.Mask2FormerDetector(
        model_dir=model_dir, clip_dir=clip_dir, device="cpu", batch_size=8, clip_loader=load_clip
    )


@pytest.fixture(scope="module")
def images():
    """Three 40×48 images: a coloured rectangle on grey, with a little noise (the tiny model's masks
    follow the rectangles somewhat, so boxes are not all the whole image)."""
    x = 0.5 + 0.05 * torch.rand(3, 3, 40, 48, generator=torch.Generator().manual_seed(0))
    x[0, :, 5:20, 8:30] = torch.tensor([1.0, 0.0, 0.0]).view(3, 1, 1)
    x[1, :, 20:38, 2:20] = torch.tensor([0.0, 0.0, 1.0]).view(3, 1, 1)
    x[2, :, 0:15, 30:48] = torch.tensor([0.0, 1.0, 0.0]).view(3, 1, 1)
    return x


def test_instances_match_a_hand_computation():
    g = torch.Generator().manual_seed(1)
    class_logits = torch.randn(3, 4, generator=g)  # 3 queries, 3 classes + no object
    mask_logits = torch.randn(3, 5, 6, generator=g)
    mask_logits[1] = -1.0  # query 1: empty mask → none of its pairs
    mask_logits[2] = -1.0
    mask_logits[2, 1:3, 2:5] = 2.0  # query 2: a 2×3 block at x 2..4, y 1..2
    probs = class_logits.softmax(-1)
    expected = []
    for q in (0, 2):
        binary = mask_logits[q] > 0
        ys, xs = torch.nonzero(binary, as_tuple=True)
        box = (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)
        mask_mean = mask_logits[q].sigmoid()[binary].mean()
        expected += [(c, float(probs[q, c] * mask_mean), box) for c in range(3)]
    expected.sort(key=lambda e: -e[1])
    got = m2f.instances(class_logits, mask_logits, min_score=0.0)
    assert [(i.label, i.box) for i in got] == [(c, box) for c, _, box in expected]
    assert [i.score for i in got] == pytest.approx([s for _, s, _ in expected], abs=1e-6)
    block = [i for i in got if i.box == (2, 1, 5, 3)][0]
    assert block.mask.shape == (2, 3) and block.mask.all()
    # max_per_image keeps the top (query, class) probabilities; min_score drops the rest
    top2 = probs[:, :-1].flatten().topk(2).indices
    assert len(m2f.instances(class_logits, mask_logits, max_per_image=2, min_score=0.0)) == sum(
        int(i // 3) != 1 for i in top2
    )
    assert m2f.instances(class_logits, mask_logits, min_score=1.1) == []


def test_upsampler_crops_the_padding_and_boxes_are_exclusive():
    logits = torch.full((1, 4, 4), -5.0)
    logits[0, :2, :2] = 5.0  # top-left quarter of the padded input
    up = m2f.mask_upsampler(padded=(4, 4), resized=(2, 2), out=(6, 6))
    (inst,) = m2f.instances(torch.tensor([[5.0, -5.0]]), logits, up)
    assert inst.box == (0, 0, 6, 6)  # the valid 2×2 region fills the image
    masks = torch.zeros(2, 5, 7, dtype=torch.bool)
    masks[0, 1:3, 2:6] = True
    masks[1, 4, 0] = True
    assert m2f.mask_boxes(masks).tolist() == [[2, 1, 6, 3], [0, 4, 1, 5]]


def test_prepare_resizes_pads_and_normalises(model_dir):
    cfg = m2f.preprocess_config(model_dir)
    pixels, resized = m2f.prepare(torch.full((2, 3, 40, 48), 0.25), cfg)
    assert resized == (64, 77)  # scale min(64 / 40, 96 / 48) = 1.6; 48 · 1.6 + 0.5 → 77
    assert pixels.shape == (2, 3, 64, 96)
    mean, std = torch.tensor(m2f.IMAGENET_MEAN), torch.tensor(m2f.IMAGENET_STD)
    assert torch.allclose(pixels[0, :, 10, 10], (0.25 - mean) / std, atol=1e-6)
    assert torch.allclose(pixels[1, :, 10, 90], (m2f.PAD - mean) / std, atol=1e-6)
    assert m2f.preprocess_config(model_dir, image_size=800)["shortest"] == 800


def test_masked_crop_matches_a_hand_built_one():
    image = torch.arange(3 * 6 * 8, dtype=torch.float32).view(3, 6, 8) / 200
    mask = torch.zeros(6, 8, dtype=torch.bool)
    mask[1, 3] = mask[2, 2:6] = mask[3, 4] = True
    box = m2f.mask_boxes(mask[None])[0].tolist()
    assert box == [2, 1, 6, 4]
    expected = torch.full((3, 3, 4), 153 / 255)
    for y in range(1, 4):
        for x in range(2, 6):
            if mask[y, x]:
                expected[:, y - 1, x - 2] = image[:, y, x]
    got = m2f.masked_crop(image, mask[1:4, 2:6], box)
    assert torch.equal(got, expected)


def _summary(result):
    """(class, score, box) of every detection of one image, by index."""
    scene, _ = result
    return sorted((f.index, name, f.score, f.box) for name, found in scene.items() for f in found)


def test_batched_call_equals_one_image_at_a_time(detector, images):
    batched = detector(images, [{}] * 3)
    assert any(scene for scene, _ in batched)  # the biased head does detect cups / dogs
    boxes = {f.box for scene, _ in batched for found in scene.values() for f in found}
    assert len(boxes) > 3  # not only whole-image masks
    for i in range(3):
        alone = _summary(detector(images[i : i + 1], [{}])[0])
        together = _summary(batched[i])
        assert [(k, n) for k, n, _, _ in alone] == [(k, n) for k, n, _, _ in together]
        for (_, _, s1, b1), (_, _, s2, b2) in zip(alone, together):
            assert s1 == pytest.approx(s2, abs=1e-4)
            assert b1 == pytest.approx(b2, abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dtypes_give_finite_scores_and_boxes_inside_the_image(model_dir, clip_dir, images, dtype):
    det = m2f.Mask2FormerDetector(
        model_dir=model_dir, clip_dir=clip_dir, device="cpu", dtype=dtype, clip_loader=load_clip
    )
    assert det.classes == COCO_CLASSES
    results = det(images, [{}] * 3)
    found = [f for scene, _ in results for group in scene.values() for f in group]
    assert found
    for f in found:
        x0, y0, x1, y1 = f.box
        assert 0 <= f.score <= 1 and 0 <= x0 < x1 <= 48 and 0 <= y0 < y1 <= 40
    scene, colors = results[0]
    name, group = next(iter(scene.items()))
    assert all(c in COLORS for c in colors(name, group))


def test_color_fn_classifies_each_objects_masked_crop(detector, images):
    (scene, colors), found = detector(images[:1], [{}])[0], detector.detect(images[:1])[0]
    name, group = next(iter(scene.items()))
    crops = [m2f.masked_crop(images[0], found[f.index].mask, found[f.index].box) for f in group]
    assert all(detector.classes[found[f.index].label] == name for f in group)
    assert colors(name, group) == detector.colors(name, crops)


def test_color_classifier_matches_an_independent_computation(detector, clip_dir):
    from transformers import AutoTokenizer, CLIPModel

    model, tok = CLIPModel.from_pretrained(clip_dir), AutoTokenizer.from_pretrained(clip_dir)
    rows = []
    for color in COLORS:
        texts = [
            f"a photo of a {color} cup",
            f"a photo of a {color}-colored cup",
            f"a photo of a {color} object",
        ]
        with torch.no_grad():
            embs = [model.get_text_features(**tok(t, return_tensors="pt")).pooler_output[0] for t in texts]
        rows.append(F.normalize(torch.stack([F.normalize(e, dim=0) for e in embs]).mean(0), dim=0))
    classifier = torch.stack(rows)  # (10, D)
    assert torch.allclose(detector.classifier("cup"), classifier, atol=1e-5)
    crops = list(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(2)))  # CLIP's size
    mean = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        feats = model.get_image_features(pixel_values=(torch.stack(crops) - mean) / std).pooler_output
    cos = F.normalize(feats, dim=-1) @ classifier.T
    ours = m2f.crop_embeds(detector.clip, crops) @ detector.classifier("cup").T
    assert torch.allclose(ours, cos, atol=1e-5)
    assert detector.colors("cup", crops) == [COLORS[int(j)] for j in cos.argmax(1)]


METAS = [
    {
        "tag": "colors",
        "include": [{"class": "cup", "count": 1, "color": "purple"}],
        "prompt": "a photo of a purple cup",
    },
    {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
        "prompt": "a photo of two dogs",
    },
    {
        "tag": "position",
        "include": [{"class": "dog", "count": 1}, {"class": "cup", "count": 1, "position": ["left of", 0]}],
        "prompt": "a photo of a cup left of a dog",
    },
]


def test_geneval_reward_path(model_dir, clip_dir, images):
    opts = {"model_dir": str(model_dir), "clip_dir": str(clip_dir), "device": "cpu"}
    reward = get_reward("geneval", {"geneval": opts})
    prompts = [m["prompt"] for m in METAS]
    values = reward(images, prompts, METAS)
    assert values.shape == (3,) and torch.isfinite(values).all()
    assert ((values >= 0) & (values <= 1)).all()
    table = get_reward("geneval", {"geneval": {**opts, "score": "strict"}})
    assert set(table(images, prompts, METAS).tolist()) <= {0.0, 1.0}
    bad = {"tag": "single_object", "include": [{"class": "unicorn", "count": 1}], "prompt": "a unicorn"}
    with pytest.raises(UserError, match=r"'a unicorn'.*unknown class 'unicorn'"):
        reward(images[:1], ["a unicorn"], [bad])


def test_missing_or_bad_weights_name_the_option_and_path(model_dir, clip_dir, tmp_path):
    cases = [
        ({"model_dir": tmp_path / "no_model", "clip_dir": clip_dir}, r"'model_dir'.*no_model"),
        ({"model_dir": model_dir, "clip_dir": tmp_path / "no_clip"}, r"'clip_dir'.*no_clip"),
        ({"model_dir": tmp_path, "clip_dir": clip_dir}, r"'model_dir'.*safetensors"),
    ]
    for opts, pattern in cases:
        with pytest.raises(UserError, match=pattern):
            m2f.Mask2FormerDetector(**opts, device="cpu", clip_loader=load_clip)
    odd = save_tiny_mask2former(tmp_path / "odd", labels=("cup", "unicorn"), bias=())
    with pytest.raises(UserError, match=r"'model_dir'.*odd.*unicorn"):
        m2f.Mask2FormerDetector(model_dir=odd, clip_dir=clip_dir, device="cpu", clip_loader=load_clip)
