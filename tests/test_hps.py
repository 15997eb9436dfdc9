"""HPSv2.1 reward (flowcredit/rewards/hps.py) on a tiny random model in the released layout: an open_clip
state dict under ``{"state_dict": ...}`` saved with torch.save, converted, scored, and checked against a
forward pass written here from the raw open_clip tensors."""

import argparse
import gzip
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

from flowcredit.errors import UserError
from flowcredit.rewards import REWARDS, get_reward
from flowcredit.rewards.clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from flowcredit.rewards.hps import (
    convert,
    hps,
    hps_preprocess,
    letterbox_geometry,
    load_hps,
    main,
    read_released,
)
from flowcredit.rewards.open_clip_layout import add_model_config

NAME = "hps-tiny-test"
# merges in open_clip's file format; "</w>" ends a word
MERGES = ["r e", "re d</w>", "c a", "ca t</w>", "b l", "bl u", "blu e</w>", "d o", "do g</w>"]
IDS = {"a": 320, "red": 513, "cat": 515, "blue": 518, "dog": 520}  # "a</w>" is 320 in open_clip's vocab too
SOT, EOT = 512 + len(MERGES), 513 + len(MERGES)
CONFIG = {
    "embed_dim": 8,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": EOT + 1, "width": 16, "heads": 2, "layers": 2},
}
PROMPTS = ["red cat", "a blue dog", "Blue  CAT", "dog"]


def open_clip_state(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under open_clip's CLIP keys (ViT + text transformer, as ViT-H-14's)."""
    v, t, dim = cfg["vision_cfg"], cfg["text_cfg"], cfg["embed_dim"]
    wv, wt, p = v["width"], t["width"], v["patch_size"]
    shapes = {
        "logit_scale": (),
        "visual.class_embedding": (wv,),
        "visual.positional_embedding": ((v["image_size"] // p) ** 2 + 1, wv),
        "visual.conv1.weight": (wv, 3, p, p),
        "visual.proj": (wv, dim),
        "token_embedding.weight": (t["vocab_size"], wt),
        "positional_embedding": (t["context_length"], wt),
        "text_projection": (wt, dim),
    }
    norms = {"visual.ln_pre": wv, "visual.ln_post": wv, "ln_final": wt}
    for tower, width, layers in (("visual.transformer", wv, v["layers"]), ("transformer", wt, t["layers"])):
        for i in range(layers):
            b = f"{tower}.resblocks.{i}"
            shapes |= {f"{b}.attn.in_proj_weight": (3 * width, width), f"{b}.attn.in_proj_bias": (3 * width,)}
            shapes |= {f"{b}.attn.out_proj.weight": (width, width), f"{b}.attn.out_proj.bias": (width,)}
            shapes |= {f"{b}.mlp.c_fc.weight": (4 * width, width), f"{b}.mlp.c_fc.bias": (4 * width,)}
            shapes |= {f"{b}.mlp.c_proj.weight": (width, 4 * width), f"{b}.mlp.c_proj.bias": (width,)}
            norms |= {f"{b}.ln_1": width, f"{b}.ln_2": width}
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=g) * 0.3 for k, s in shapes.items()}
    for n, width in norms.items():
        state[f"{n}.weight"] = 1 + 0.1 * torch.randn(width, generator=g)
        state[f"{n}.bias"] = 0.1 * torch.randn(width, generator=g)
    return state


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny model registered, its BPE file, the released-style .pt and its conversion."""
    d = tmp_path_factory.mktemp("hps")
    add_model_config(NAME, CONFIG)
    bpe = d / "bpe.txt.gz"
    bpe.write_bytes(gzip.compress(("#version: 0.2\n" + "\n".join(MERGES) + "\n").encode()))
    state = open_clip_state(CONFIG)
    pt, out = d / "HPS_tiny_compressed.pt", d / "hps_tiny.safetensors"
    torch.save({"epoch": 1, "state_dict": state}, pt)
    assert main(["convert", "--checkpoint", str(pt), "--out", str(out), "--model_name", NAME]) == 0
    return {"dir": d, "bpe": bpe, "state": state, "checkpoint": out}


def reward(files, **kw):
    return hps(checkpoint=files["checkpoint"], model_name=NAME, bpe_path=files["bpe"], device="cpu", **kw)


def ref_block(x, sd, pre, heads, mask=None):
    """open_clip's residual block from its raw tensors (packed q, k, v as nn.MultiheadAttention)."""

    def ln(z, n):
        return F.layer_norm(z, z.shape[-1:], sd[f"{pre}.{n}.weight"], sd[f"{pre}.{n}.bias"])

    b, n, c = x.shape
    q, k, v = (ln(x, "ln_1") @ sd[f"{pre}.attn.in_proj_weight"].T + sd[f"{pre}.attn.in_proj_bias"]).chunk(
        3, -1
    )
    q, k, v = (z.view(b, n, heads, c // heads).transpose(1, 2) for z in (q, k, v))
    att = q @ k.transpose(-1, -2) / math.sqrt(c // heads) + (0 if mask is None else mask)
    o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
    x = x + o @ sd[f"{pre}.attn.out_proj.weight"].T + sd[f"{pre}.attn.out_proj.bias"]
    h = F.gelu(ln(x, "ln_2") @ sd[f"{pre}.mlp.c_fc.weight"].T + sd[f"{pre}.mlp.c_fc.bias"])
    return x + h @ sd[f"{pre}.mlp.c_proj.weight"].T + sd[f"{pre}.mlp.c_proj.bias"]


def ref_scores(sd, images, token_ids):
    """Cosine of open_clip's image and text features, by hand; images at the model's size already."""
    v, t = CONFIG["vision_cfg"], CONFIG["text_cfg"]
    mean, std = (
        torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1),
        torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1),
    )
    x = F.conv2d((images - mean) / std, sd["visual.conv1.weight"], stride=v["patch_size"]).flatten(2).mT
    x = (
        torch.cat([sd["visual.class_embedding"].expand(len(x), 1, -1), x], 1)
        + sd["visual.positional_embedding"]
    )
    x = F.layer_norm(x, x.shape[-1:], sd["visual.ln_pre.weight"], sd["visual.ln_pre.bias"])
    for i in range(v["layers"]):
        x = ref_block(x, sd, f"visual.transformer.resblocks.{i}", v["width"] // v["head_width"])
    img = F.layer_norm(x[:, 0], x.shape[-1:], sd["visual.ln_post.weight"], sd["visual.ln_post.bias"])
    ids = torch.zeros(len(token_ids), t["context_length"], dtype=torch.long)  # open_clip pads with 0
    for row, seq in zip(ids, token_ids):
        row[: len(seq)] = torch.tensor(seq)
    x = sd["token_embedding.weight"][ids] + sd["positional_embedding"]
    causal = torch.full((t["context_length"],) * 2, float("-inf")).triu(1)
    for i in range(t["layers"]):
        x = ref_block(x, sd, f"transformer.resblocks.{i}", t["heads"], causal)
    x = F.layer_norm(x, x.shape[-1:], sd["ln_final.weight"], sd["ln_final.bias"])
    txt = x[torch.arange(len(ids)), ids.argmax(-1)] @ sd["text_projection"]
    return F.cosine_similarity(img @ sd["visual.proj"], txt, dim=-1)


def test_registered_lazily():
    assert REWARDS["hps"].target == "flowcredit.rewards.hps:hps"


def test_tokens_follow_open_clip_vocabulary(files):
    tok = load_hps(files["checkpoint"], NAME, files["bpe"], "cpu", "float32").tokenizer
    assert tok("a red cat")["input_ids"] == [SOT, IDS["a"], IDS["red"], IDS["cat"], EOT]
    long = tok(" ".join(["dog"] * 40), truncation=True, max_length=16)["input_ids"]
    assert long == [SOT] + [IDS["dog"]] * 14 + [EOT]  # open_clip keeps 14 tokens and ends with EOT


def test_scores_equal_a_forward_pass_from_the_raw_weights(files):
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    words = [p.lower().split() for p in PROMPTS]
    expected = ref_scores(files["state"], images, [[SOT, *(IDS[w] for w in ws), EOT] for ws in words])
    got = reward(files)(images, PROMPTS, [{}] * 4)
    assert got.shape == (4,) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_finite_batched_and_prompt_dependent(files):
    images = torch.rand(4, 3, 48, 40, generator=torch.Generator().manual_seed(2))
    one, four = reward(files, batch_size=1), reward(files, batch_size=4)
    scores = four(images, PROMPTS, [{}] * 4)
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    torch.testing.assert_close(one(images, PROMPTS, [{}] * 4), scores, atol=1e-5, rtol=0)
    same = four(images[:1].expand(4, -1, -1, -1), PROMPTS, [{}] * 4)
    assert same.max() - same.min() > 1e-3  # one image, four prompts, four scores


def test_bfloat16_close_to_float32(files):
    images = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    full = reward(files)(images, PROMPTS, [{}] * 4)
    half = reward(files, dtype="bfloat16")(images, PROMPTS, [{}] * 4)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, full, atol=3e-2, rtol=0)


def test_registry_builds_hps(files):
    opts = {"checkpoint": str(files["checkpoint"]), "model_name": NAME, "bpe_path": str(files["bpe"])}
    r = get_reward("hps", {"hps": {**opts, "device": "cpu"}})
    assert r(torch.rand(2, 3, 32, 32), PROMPTS[:2], [{}, {}]).shape == (2,)


# HPSv2 scores with a letterbox, not a crop. The test that stood here pinned the shortest-edge resize and
# torchvision-rounded centre crop of open_clip's default eval transform; HPSv2's img_score.py builds its
# transform with light_augmentation=True (resize_longest_max=True: hpsv2/src/open_clip/factory.py and
# transform.py's ResizeMaxSize), so that behaviour was wrong for every non-square image and is replaced by
# the three tests below.
NORMALISED_BLACK = (0 - torch.tensor(OPENAI_CLIP_MEAN)) / torch.tensor(OPENAI_CLIP_STD)


def pil_letterbox(x: torch.Tensor, size: int) -> torch.Tensor:
    """HPSv2's eval transform on one float image ``(3, H, W)``, from its documented steps, with PIL only.

    ``ToTensor`` comes first in HPSv2, so the resize is of float pixels: PIL's float ("F") bicubic
    resample, per channel (torch's antialiased bicubic uses PIL's kernel, a = -0.5, and its support).
    The long side goes to ``size``, the other to ``round(side * size / long)``; the result is pasted on a
    black (0.0) canvas at ``(pad_w // 2, pad_h // 2)``, then normalised with OpenAI's mean/std.
    """
    _, h, w = x.shape
    scale = size / max(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    left, top = (size - new_w) // 2, (size - new_h) // 2
    channels = []
    for plane in x.numpy().astype(np.float32):
        resized = Image.fromarray(plane).resize((new_w, new_h), Image.BICUBIC)
        canvas = Image.new("F", (size, size), 0.0)
        canvas.paste(resized, (left, top))
        channels.append(np.asarray(canvas))
    out = torch.from_numpy(np.stack(channels))
    return (out - torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)


@pytest.mark.parametrize(
    "hw",
    [
        (512, 768),  # landscape, downscaled to 149 x 224: 75 rows of padding, 37 above and 38 below
        (96, 160),  # landscape, upscaled to 134 x 224: 45 rows above and below
        (100, 61),  # portrait, upscaled to 224 x 137: 87 columns, 43 left and 44 right
        (768, 512),  # portrait, downscaled to 224 x 149
    ],
)
def test_preprocess_is_hpsv2_letterbox_on_non_square_images(hw):
    x = torch.rand(2, 3, *hw, generator=torch.Generator().manual_seed(sum(hw)))
    got = hps_preprocess(x, 224)
    expected = torch.stack([pil_letterbox(img, 224) for img in x])
    assert got.shape == (2, 3, 224, 224)
    # float32 round-off of the resampling: torch places its kernel in float32, PIL in double (measured
    # at most 4e-5 in normalised units; the shortest-edge crop that stood here differed by ~1 on average)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_padding_is_normalised_black_and_odd_padding_goes_below():
    x = torch.rand(1, 3, 512, 768, generator=torch.Generator().manual_seed(6))
    out = hps_preprocess(x, 224)[0]
    black = NORMALISED_BLACK.view(3, 1, 1).expand(3, 224, 224)
    # 512 x 768 -> 149 x 224: pad 75 = 37 rows above, 38 below (by hand from ResizeMaxSize)
    torch.testing.assert_close(out[:, :37], black[:, :37], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[:, 186:], black[:, 186:], atol=1e-6, rtol=0)
    assert (out[:, 37] - black[:, 37]).abs().amin() > 1e-3 and (
        out[:, 185] - black[:, 185]
    ).abs().amin() > 1e-3
    # a long side already at 224 is not resized: here columns 37..186 are the image, exactly
    y = torch.rand(1, 3, 224, 150, generator=torch.Generator().manual_seed(7))
    mean, std = torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1), torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    padded = hps_preprocess(y, 224)[0]
    torch.testing.assert_close(padded[..., 37:187], (y[0] - mean) / std, atol=1e-6, rtol=0)
    torch.testing.assert_close(padded[..., :37], black[..., :37], atol=1e-6, rtol=0)
    torch.testing.assert_close(padded[..., 187:], black[..., 187:], atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "hw, resized, padding",  # padding: (left, right, top, bottom), as torch.nn.functional.pad
    [
        ((512, 768), (149, 224), (0, 0, 37, 38)),  # 768 * 224/768, 512 * 0.2917 = 149.33 -> 149
        ((768, 512), (224, 149), (37, 38, 0, 0)),
        ((100, 61), (224, 137), (43, 44, 0, 0)),  # 61 * 2.24 = 136.64 -> 137
        ((96, 160), (134, 224), (0, 0, 45, 45)),  # 96 * 1.4 = 134.4 -> 134
        ((10, 896), (2, 224), (0, 0, 111, 111)),  # 10 * 0.25 = 2.5 -> 2: Python's round, halves to even
        ((224, 150), (224, 150), (37, 37, 0, 0)),  # not resized; HPSv2 would not pad it either (docstring)
        ((32, 32), (32, 32), (0, 0, 0, 0)),
    ],
)
def test_letterbox_geometry_by_hand(hw, resized, padding):
    size = 32 if hw == (32, 32) else 224
    assert letterbox_geometry(*hw, size) == (resized, padding)


def test_missing_checkpoint_names_option_and_path(files, tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(UserError, match=r"'checkpoint'.*nope\.safetensors"):
        reward({**files, "checkpoint": missing})
    with pytest.raises(UserError, match=r"'bpe_path'.*nobpe\.gz"):
        reward({**files, "bpe": tmp_path / "nobpe.gz"})


def test_pickle_is_refused_by_the_reward(files):
    with pytest.raises(ValueError, match=r"not a safetensors file.*convert"):
        reward({**files, "checkpoint": files["dir"] / "HPS_tiny_compressed.pt"})


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_a_wrong_key_is_named(files, tmp_path, capsys, change):
    state = dict(files["state"])
    key = "transformer.resblocks.1.mlp.c_fc.bias"
    if change == "missing":
        del state[key]
    else:
        key = "visual.extra_head.weight"
        state[key] = torch.zeros(2)
    torch.save({"state_dict": state}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=f"{change} key '{key}'"):
        convert(tmp_path / "bad.pt", tmp_path / "x.safetensors", NAME)
    assert (
        main(["convert", "--checkpoint", str(tmp_path / "bad.pt"), "--out", "x", "--model_name", NAME]) == 1
    )
    assert f"{change} key '{key}'" in capsys.readouterr().err
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=f"{change} key '{key}'"):
        reward({**files, "checkpoint": tmp_path / "bad.safetensors"})


def test_convert_keeps_the_open_clip_state_dict(files):
    saved = load_file(str(files["checkpoint"]))
    assert saved.keys() == files["state"].keys()
    assert all(torch.equal(saved[k], v) for k, v in files["state"].items())


def test_bad_model_config_is_named(files):
    with pytest.raises(ValueError, match="unknown open_clip model_name 'ViT-Z-99'"):
        hps(checkpoint=files["checkpoint"], model_name="ViT-Z-99", bpe_path=files["bpe"], device="cpu")
    add_model_config(
        "hps-attnpool-test", {**CONFIG, "vision_cfg": {**CONFIG["vision_cfg"], "attentional_pool": True}}
    )
    with pytest.raises(ValueError, match=r"vision_cfg\.attentional_pool = True is not supported"):
        hps(
            checkpoint=files["checkpoint"],
            model_name="hps-attnpool-test",
            bpe_path=files["bpe"],
            device="cpu",
        )


def test_torch_load_only_in_the_converter():
    from pathlib import Path

    import flowcredit.rewards.hps as mod

    src = Path(mod.__file__).read_text()
    assert src.count("torch.load(") == 1 and "weights_only=True" in src


def test_released_reader_strips_ddp_prefix_and_refuses_objects(tmp_path):
    torch.save(
        {"epoch": 3, "name": "run", "state_dict": {"module.logit_scale": torch.ones(())}}, tmp_path / "a.pt"
    )
    assert list(read_released(tmp_path / "a.pt")) == ["logit_scale"]
    torch.save({"state_dict": {"x": torch.ones(1)}, "args": argparse.Namespace(lr=1)}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match=r"b\.pt.*weights_only=True"):
        read_released(tmp_path / "b.pt")
