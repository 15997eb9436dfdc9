"""The ``imagereward`` reward (BLIP ImageReward) on a tiny random checkpoint in the RELEASED key layout,
converted by ``python -m flowcredit.rewards.imagereward_convert convert``: flowcredit/rewards/imagereward*.py.

The independent test recomputes a score by hand from the raw released tensors (plain torch ops), which
is what shows that the key mapping and the computation match ImageReward's BLIP."""

import json
import math
import re

import pytest
import torch

from flowcredit.errors import UserError
from flowcredit.rewards import get_reward
from flowcredit.rewards.imagereward import (
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    centre_crop_offsets,
    image_config,
    imagereward_preprocess,
)
from flowcredit.rewards.imagereward_convert import main

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["a", "red", "blue", "green", "square", "circle", "photo", "of", "cat", "dog"]
VOCAB = {t: i for i, t in enumerate([*SPECIAL, *WORDS, "[DEC]", "[ENC]"])}
VW, VL, VH, IMG, PATCH = 48, 2, 3, 32, 16  # vision width, layers, heads, image size, patch
TW, TL, TH, MAXPOS = 32, 2, 2, 40  # text width, layers, heads, max positions
HEAD = [(0, TW, 16), (2, 16, 8), (4, 8, 4), (6, 4, 2), (7, 2, 1)]  # released nn.Sequential indices
MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)


def save_tokenizer(path):
    """A tiny lower-casing BERT WordPiece tokenizer (``[CLS] … [SEP]``), saved into ``path``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = VOCAB["[CLS]"], VOCAB["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(path)
    return path


def released_state_dict(seed=0) -> dict:
    """Random tensors named and shaped as ImageReward.pt's (``blip.*`` BLIP, ``mlp.layers.*`` head)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}

    def lin(name, d_out, d_in):
        sd[name + ".weight"] = torch.randn(d_out, d_in, generator=g) / math.sqrt(d_in)
        sd[name + ".bias"] = 0.1 * torch.randn(d_out, generator=g)

    def norm(name, d):
        sd[name + ".weight"] = 1 + 0.2 * torch.randn(d, generator=g)
        sd[name + ".bias"] = 0.2 * torch.randn(d, generator=g)

    v = "blip.visual_encoder."
    sd[v + "cls_token"] = torch.randn(1, 1, VW, generator=g)
    sd[v + "pos_embed"] = torch.randn(1, (IMG // PATCH) ** 2 + 1, VW, generator=g)
    sd[v + "patch_embed.proj.weight"] = torch.randn(VW, 3, PATCH, PATCH, generator=g) / (PATCH * 3**0.5)
    sd[v + "patch_embed.proj.bias"] = 0.1 * torch.randn(VW, generator=g)
    for n in range(VL):
        b = f"{v}blocks.{n}."
        norm(b + "norm1", VW), lin(b + "attn.qkv", 3 * VW, VW), lin(b + "attn.proj", VW, VW)
        norm(b + "norm2", VW), lin(b + "mlp.fc1", 4 * VW, VW), lin(b + "mlp.fc2", VW, 4 * VW)
    norm(v + "norm", VW)
    t = "blip.text_encoder."
    sd[t + "embeddings.word_embeddings.weight"] = torch.randn(len(VOCAB), TW, generator=g)
    sd[t + "embeddings.position_embeddings.weight"] = torch.randn(MAXPOS, TW, generator=g)
    sd[t + "embeddings.position_ids"] = torch.arange(MAXPOS).unsqueeze(0)
    norm(t + "embeddings.LayerNorm", TW)
    for n in range(TL):
        b = f"{t}encoder.layer.{n}."
        for att, kv_in in (("attention", TW), ("crossattention", VW)):
            lin(b + att + ".self.query", TW, TW)
            lin(b + att + ".self.key", TW, kv_in), lin(b + att + ".self.value", TW, kv_in)
            lin(b + att + ".output.dense", TW, TW), norm(b + att + ".output.LayerNorm", TW)
        lin(b + "intermediate.dense", 2 * TW, TW), lin(b + "output.dense", TW, 2 * TW)
        norm(b + "output.LayerNorm", TW)
    lin("blip.vision_proj", 8, VW), lin("blip.text_proj", 8, TW)  # in the release, unused by the score
    for idx, d_in, d_out in HEAD:
        lin(f"mlp.layers.{idx}", d_out, d_in)
    return sd


def convert(tmp, sd, name="ckpt"):
    """``torch.save`` ``sd`` as ``tmp/<name>.pt`` and run the converter's command line on it."""
    pt = tmp / f"{name}.pt"
    torch.save(sd, pt)
    out = tmp / f"{name}_model"
    argv = ["convert", "--checkpoint", str(pt), "--tokenizer", str(tmp / "tok"), "--out", str(out)]
    return main([*argv, "--vision-heads", str(VH), "--text-heads", str(TH)]), out


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("imagereward")
    save_tokenizer(tmp / "tok")
    sd = released_state_dict()
    rc, out = convert(tmp, sd)
    assert rc == 0
    return tmp, sd, out


def reward(out, **opts):
    return get_reward("imagereward", {"imagereward": {"model_dir": str(out), "device": "cpu", **opts}})


PROMPTS = ["a red square", "a photo of a cat", "blue circle", "green dog"]


def images(n=4, h=IMG, w=IMG, seed=1):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed))


def test_scores_batching_and_prompt_dependence(released):
    _, _, out = released
    x, metas = images(), [{}] * 4
    a = reward(out)(x, PROMPTS, metas)
    assert a.shape == (4,) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.allclose(reward(out, batch_size=1)(x, PROMPTS, metas), a, atol=1e-5)
    assert not torch.allclose(reward(out)(x, PROMPTS[::-1], metas), a, atol=1e-3)
    odd = reward(out)(images(2, 40, 56), PROMPTS[:2], [{}] * 2)  # resized and centre-cropped
    assert odd.shape == (2,) and torch.isfinite(odd).all()


# torchvision's center_crop (torchvision/transforms/functional.py): top = int(round((H - h) / 2.0)), left
# likewise; Python's round takes halves to even. By hand, excess -> offset (floor in brackets):
# 1 -> round(0.5) = 0 (0), 3 -> round(1.5) = 2 (1), 5 -> round(2.5) = 2 (2), 7 -> round(3.5) = 4 (3).
@pytest.mark.parametrize(
    "hw, offsets",
    [
        ((224, 225), (0, 0)),
        ((224, 227), (0, 2)),
        ((229, 224), (2, 0)),
        ((231, 224), (4, 0)),
        ((256, 256), (16, 16)),
    ],
)
def test_centre_crop_offsets_round_as_torchvision(hw, offsets):
    assert centre_crop_offsets(*hw, 224, 224) == offsets


@pytest.mark.parametrize("hw, top, left", [((IMG, 35), 0, 2), ((39, IMG), 4, 0), ((IMG, 37), 0, 2)])
def test_preprocess_crops_at_torchvision_offsets(hw, top, left):
    pre = image_config(
        {
            "vision": {"image_size": IMG},
            "image_mean": MEAN.flatten().tolist(),
            "image_std": STD.flatten().tolist(),
        }
    )
    x = images(2, *hw)  # the shortest edge is already IMG: not resized, only cropped
    expected = (x[..., top : top + IMG, left : left + IMG] - MEAN) / STD
    torch.testing.assert_close(imagereward_preprocess(x, pre), expected, atol=1e-6, rtol=0)


def test_score_of_a_cropped_size_is_the_score_of_torchvisions_crop(released):
    _, _, out = released
    x = images(2, IMG, 35)  # 3 columns too many: torchvision keeps columns 2..33, a floor 1..32
    got = reward(out)(x, PROMPTS[:2], [{}] * 2)
    torch.testing.assert_close(got, reward(out)(x[..., 2:34], PROMPTS[:2], [{}] * 2), atol=1e-6, rtol=0)
    assert (got - reward(out)(x[..., 1:33], PROMPTS[:2], [{}] * 2)).abs().max() > 1e-4


def test_bfloat16_close_to_float32(released):
    _, _, out = released
    x, metas = images(), [{}] * 4
    f32 = reward(out)(x, PROMPTS, metas)
    bf16 = reward(out, dtype="bfloat16")(x, PROMPTS, metas)
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert torch.allclose(bf16, f32, atol=0.03)  # measured: 0.008 apart; the four scores span 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 0.03)])
def test_cuda_matches_cpu(released, dtype, atol):
    _, _, out = released
    x, metas = images(), [{}] * 4
    cpu = reward(out)(x, PROMPTS, metas)
    cuda = reward(out, device="cuda", dtype=dtype)(x, PROMPTS, metas)
    assert cuda.device.type == "cpu" and torch.allclose(cuda, cpu, atol=atol)


def _ln(x, sd, name, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * sd[name + ".weight"] + sd[name + ".bias"]


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _lin(x, sd, name):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def _attend(q, k, v, heads, key_bias=None):
    """Softmax attention written out: ``(B, Lq, D), (B, Lk, D)`` → ``(B, Lq, D)``."""
    b, lq, d = q.shape
    split = lambda t: t.reshape(b, t.shape[1], heads, d // heads).transpose(1, 2)
    scores = split(q) @ split(k).transpose(-1, -2) / math.sqrt(d // heads)
    if key_bias is not None:
        scores = scores + key_bias[:, None, None, :]
    return (scores.softmax(-1) @ split(v)).transpose(1, 2).reshape(b, lq, d)


def by_hand(sd, image, ids, mask):
    """ImageReward's score from the released tensors: ViT → BERT with cross-attention → [CLS] → MLP."""
    v, t = "blip.visual_encoder.", "blip.text_encoder."
    pix = (image - MEAN) / STD
    x = torch.nn.functional.conv2d(pix, sd[v + "patch_embed.proj.weight"], stride=PATCH)
    x = x + sd[v + "patch_embed.proj.bias"].view(1, -1, 1, 1)
    x = torch.cat([sd[v + "cls_token"].expand(len(x), 1, VW), x.flatten(2).transpose(1, 2)], 1)
    x = x + sd[v + "pos_embed"]
    for n in range(VL):
        b = f"{v}blocks.{n}."
        q, k, val = _lin(_ln(x, sd, b + "norm1", 1e-6), sd, b + "attn.qkv").chunk(3, dim=-1)
        x = x + _lin(_attend(q, k, val, VH), sd, b + "attn.proj")
        h = _lin(_gelu(_lin(_ln(x, sd, b + "norm2", 1e-6), sd, b + "mlp.fc1")), sd, b + "mlp.fc2")
        x = x + h
    img = _ln(x, sd, v + "norm", 1e-6)
    words = sd[t + "embeddings.word_embeddings.weight"][ids]
    positions = sd[t + "embeddings.position_embeddings.weight"][: ids.shape[1]]
    h = _ln(words + positions, sd, t + "embeddings.LayerNorm", 1e-12)
    key_bias = (1.0 - mask.float()) * -1e9
    for n in range(TL):
        b = f"{t}encoder.layer.{n}."
        for att, kv, bias in (("attention", None, key_bias), ("crossattention", img, None)):
            s = f"{b}{att}."
            src = h if kv is None else kv
            q, k, val = (
                _lin(h, sd, s + "self.query"),
                _lin(src, sd, s + "self.key"),
                _lin(src, sd, s + "self.value"),
            )
            ctx = _attend(q, k, val, TH, bias)
            h = _ln(_lin(ctx, sd, s + "output.dense") + h, sd, s + "output.LayerNorm", 1e-12)
        ff = _lin(_gelu(_lin(h, sd, b + "intermediate.dense")), sd, b + "output.dense")
        h = _ln(ff + h, sd, b + "output.LayerNorm", 1e-12)
    y = h[:, 0, :]
    for idx, _, _ in HEAD:
        y = _lin(y, sd, f"mlp.layers.{idx}")
    return (y.squeeze(-1) - IMAGEREWARD_MEAN) / IMAGEREWARD_STD


def hand_tokens(prompt, max_length=35):
    """``[CLS] words… [SEP]``, truncated to and padded with [PAD] up to ``max_length``, and its mask."""
    ids = [VOCAB["[CLS]"], *[VOCAB[w] for w in prompt.lower().split()][: max_length - 2], VOCAB["[SEP]"]]
    mask = [1] * len(ids) + [0] * (max_length - len(ids))
    return ids + [VOCAB["[PAD]"]] * (max_length - len(ids)), mask


def test_score_equals_independent_computation_from_released_tensors(released):
    _, sd, out = released
    long_prompt = " ".join(WORDS * 4)  # 40 words: truncated to 33 between [CLS] and [SEP]
    prompts = ["A red square", long_prompt]
    x = images(2)
    toks = [hand_tokens(p) for p in prompts]
    ids = torch.tensor([i for i, _ in toks])
    mask = torch.tensor([m for _, m in toks])
    expected = by_hand(
        {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}, x.double(), ids, mask
    )
    got = reward(out)(x, prompts, [{}, {}])
    assert torch.allclose(got.double(), expected, atol=1e-4), (got, expected)
    assert expected.std() > 1e-3  # the two scores differ: the check is not vacuous


def test_converter_reports_dropped_keys_and_writes_config(released, capsys):
    tmp, sd, _ = released
    rc, out = convert(tmp, sd, "again")
    report = capsys.readouterr().out
    assert rc == 0
    for key in [
        "blip.vision_proj.weight",
        "blip.text_proj.bias",
        "blip.text_encoder.embeddings.position_ids",
    ]:
        assert key in report
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vision"]["image_size"] == IMG and cfg["head_dims"] == [TW, 16, 8, 4, 2, 1]
    assert cfg["head_indices"] == [0, 2, 4, 6, 7] and cfg["max_length"] == 35


def test_missing_model_dir_names_option_and_path(tmp_path):
    with pytest.raises(UserError, match=r"imagereward.*model_dir.*no_such_dir"):
        get_reward("imagereward", {"imagereward": {"model_dir": str(tmp_path / "no_such_dir")}})


@pytest.mark.parametrize(
    "change, message",
    [
        ("drop", r"missing keys.*blip\.text_encoder\.encoder\.layer\.1\.crossattention\.self\.key\.weight"),
        ("add", r"unknown keys.*blip\.text_decoder\.cls\.weight"),
    ],
)
def test_bad_checkpoint_keys_are_named(released, capsys, change, message):
    tmp, sd, _ = released
    sd = dict(sd)
    if change == "drop":
        del sd["blip.text_encoder.encoder.layer.1.crossattention.self.key.weight"]
    else:
        sd["blip.text_decoder.cls.weight"] = torch.zeros(2)
    rc, _ = convert(tmp, sd, f"bad_{change}")
    assert rc == 2
    assert re.search(message, capsys.readouterr().err)
