"""CLIP-based rewards on a tiny random CLIP saved locally (no downloads): flowcredit/rewards/clip.py."""

import json

import pytest
import torch

from flowcredit.errors import UserError
from flowcredit.rewards import get_reward
from flowcredit.rewards.clip import load_clip, preprocess

WORDS = ["a", "red", "blue", "square", "circle", "photo", "of", "cat"]


def save_tiny_clip(path, image_size=32, projection_dim=8):
    """A tiny random CLIPModel + WordLevel tokenizer + preprocessor config, saved into ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "<bos>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=16,
    )
    text = dict(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        projection_dim=projection_dim,
    )
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=8,
        projection_dim=projection_dim,
    )
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    ).save_pretrained(path)
    fast.save_pretrained(path)
    pre = {
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "resample": 3,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return path


def save_head(path, dims):
    """Random linear layers ``dims[0] → … → 1`` with LAION-style keys (gaps where Dropouts were)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    tensors, idx = {}, 0
    for d_in, d_out in zip(dims, dims[1:]):
        tensors[f"layers.{idx}.weight"] = torch.randn(d_out, d_in, generator=g)
        tensors[f"layers.{idx}.bias"] = torch.randn(d_out, generator=g)
        idx += 2 if idx < 6 else 1  # 0, 2, 4, 6, 7: the v2 MLP's Linear indices
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    d = save_tiny_clip(tmp_path_factory.mktemp("clip"))
    save_head(d / "aesthetic_head.safetensors", [8, 16, 4, 1])
    save_head(d / "clip_product_head.safetensors", [8, 1])
    return d


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 40, 48, generator=g)
    return images, ["a red square", "a photo of a cat", "blue circle"], [{}, {}, {}]


@pytest.mark.parametrize("name", ["pickscore", "clipscore", "aesthetic", "clip_product_head"])
def test_shape_determinism_and_prompt_dependence(clip_dir, batch, name):
    images, prompts, metas = batch
    reward = get_reward(name, {name: {"model_dir": str(clip_dir), "device": "cpu"}})
    a, b = reward(images, prompts, metas), reward(images, prompts, metas)
    assert a.shape == (3,) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert torch.equal(a, b)
    # batched in chunks of one gives the same values
    chunked = get_reward(name, {name: {"model_dir": str(clip_dir), "device": "cpu", "batch_size": 1}})
    assert torch.allclose(chunked(images, prompts, metas), a, atol=1e-5)
    if name != "aesthetic":  # the aesthetic head ignores the prompt
        swapped = reward(images, prompts[::-1], metas)
        assert not torch.allclose(swapped, a)


def test_pickscore_and_clipscore_formulas(clip_dir, batch):
    images, prompts, metas = batch
    clip = load_clip("pickscore", clip_dir, "cpu", "float32")
    cos = (clip.image_embeds(images) * clip.text_embeds(prompts)).sum(-1)
    scale = clip.model.logit_scale.exp().item()
    opts = {"model_dir": str(clip_dir), "device": "cpu"}
    pick = get_reward("pickscore", {"pickscore": {**opts, "divisor": 26.0}})(images, prompts, metas)
    assert torch.allclose(pick, scale * cos / 26.0, atol=1e-5)
    cs = get_reward("clipscore", {"clipscore": opts})(images, prompts, metas)
    assert torch.allclose(cs, 2.5 * cos.clamp(min=0), atol=1e-6)


def test_preprocess_shortest_edge_crop_and_normalise(clip_dir):
    cfg = load_clip("clipscore", clip_dir, "cpu", "float32").pre
    x = torch.full((2, 3, 64, 96), 0.5)
    out = preprocess(x, cfg)
    assert out.shape == (2, 3, 32, 32)
    expected = (0.5 - torch.tensor(cfg["mean"])) / torch.tensor(cfg["std"])
    assert torch.allclose(out[0, :, 5, 5], expected, atol=1e-5)


def test_missing_dir_names_reward_option_and_path(tmp_path):
    missing = tmp_path / "no_such_model"
    for name in ["pickscore", "clipscore", "aesthetic", "clip_product_head"]:
        with pytest.raises(UserError, match=rf"{name}.*model_dir.*no_such_model"):
            get_reward(name, {name: {"model_dir": str(missing)}})


def test_missing_head_names_option_and_path(clip_dir):
    with pytest.raises(UserError, match=r"aesthetic.*head_path.*nohead"):
        get_reward(
            "aesthetic", {"aesthetic": {"model_dir": str(clip_dir), "head_path": str(clip_dir / "nohead")}}
        )


def test_head_of_wrong_width_is_rejected(clip_dir, tmp_path):
    bad = save_head(tmp_path / "bad.safetensors", [5, 1])
    with pytest.raises(ValueError, match=r"aesthetic.*from 8 features to 1"):
        get_reward("aesthetic", {"aesthetic": {"model_dir": str(clip_dir), "head_path": str(bad)}})


def test_weighted_mix_logs_each_component(clip_dir, batch):
    images, prompts, metas = batch
    opts = {"model_dir": str(clip_dir), "device": "cpu"}
    mix = get_reward("pickscore=0.5,clipscore=2", {"pickscore": opts, "clipscore": opts})
    total = mix(images, prompts, metas)
    comps = mix.last_components
    assert set(comps) == {"pickscore", "clipscore"}
    assert torch.allclose(total, 0.5 * comps["pickscore"] + 2 * comps["clipscore"])
