"""ImageReward (Xu et al. 2023, THUDM/ImageReward v1.0) from a local, converted directory.

The model is BLIP: a ViT (ViT-L/16 at 224 px for the release) encodes the image to ``v (B, 1 + N, Dv)``
(final LayerNorm included); BLIP's BERT text encoder reads the prompt with self-attention and, in every
layer, cross-attention whose keys and values are ``v``; its ``[CLS]`` output ``h (B, 768)`` goes
through a head of linear layers without activations (768 → 1024 → 128 → 64 → 16 → 1; the released MLP's
ReLUs are commented out and its Dropouts are identity at eval), and

    score = (head(h) − mean) / std,   mean = 0.16717362830052426, std = 1.0333394966054072.

As in ``ImageReward.score`` / ``inference_rank`` / ``score_gard``, the prompt is tokenised with
``padding="max_length", truncation=True, max_length=35`` and fed as is (``[CLS]`` first, not BLIP's
``[ENC]``), with its attention mask; the image tokens are not masked. Images are preprocessed as
ImageReward's torchvision transform: shortest edge to 224 (bicubic), centre crop 224 with torchvision's
rounded offsets, CLIP mean/std (in torch: :func:`imagereward_preprocess`).

``model_dir`` is written once by ``python -m flowcredit.rewards.imagereward_convert`` from the released
``ImageReward.pt`` (:mod:`flowcredit.rewards.imagereward_convert`): ``model.safetensors`` in this module's
key layout (``vision.*`` = ``transformers.BlipVisionModel``, ``text.*`` = ``BlipTextModel`` with
cross-attention, ``head.layers.i.*``), ``config.json`` (sizes, mean/std, max_length) and the tokenizer.
Nothing is downloaded and no pickle is read at run time.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
from torch import nn

from flowcredit.errors import PathError, reading
from flowcredit.models.diffusers_common import default_device
from flowcredit.rewards.clip import _DTYPES, _existing, batched_reward, check_dtype, option, preprocess

NAME = "imagereward"
MODEL_DIR = option(NAME, "model_dir")
"""How errors name the reward's one path option."""
CONFIG_FORMAT = "flowcredit-imagereward"
IMAGEREWARD_MEAN = 0.16717362830052426
IMAGEREWARD_STD = 1.0333394966054072
MAX_LENGTH = 35


class ImageRewardHead(nn.Module):
    """Affine layers ``dims[0] → … → dims[-1] = 1`` applied in order, no activations: ``(B, D) → (B,)``."""

    def __init__(self, dims: list[int]):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.squeeze(-1)


def vision_config(cfg: dict):
    """``BlipVisionConfig`` from ``config.json``'s ``vision`` entry (GELU, eps 1e-6 as BLIP's timm ViT)."""
    from transformers import BlipVisionConfig

    return BlipVisionConfig(**cfg["vision"], hidden_act="gelu", attention_dropout=0.0)


def text_config(cfg: dict):
    """``BlipTextConfig`` from ``config.json``'s ``text`` entry.

    ``is_decoder=True`` only makes ``BlipTextModel`` build its cross-attention layers (BLIP's
    ``add_cross_attention``); the forward pass runs bidirectionally (``is_decoder=False``, the default).
    """
    from transformers import BlipTextConfig

    t = cfg["text"]
    return BlipTextConfig(
        **t,
        encoder_hidden_size=cfg["vision"]["hidden_size"],
        hidden_act="gelu",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,
        use_cache=False,
        bos_token_id=None,
        eos_token_id=None,
        sep_token_id=None,
        attn_implementation="eager",  # BlipTextSelfAttention adds the mask to its scores: it must be additive
    )


class ImageRewardModel(nn.Module):
    """``pixel_values (B, 3, S, S)``, ``input_ids``/``attention_mask (B, L)`` → raw head output ``(B,)``."""

    def __init__(self, cfg: dict):
        super().__init__()
        from transformers import BlipTextModel, BlipVisionModel

        self.vision = BlipVisionModel(vision_config(cfg))
        self.text = BlipTextModel(text_config(cfg), add_pooling_layer=False)
        self.head = ImageRewardHead(cfg["head_dims"])

    def forward(self, pixel_values, input_ids, attention_mask) -> torch.Tensor:
        image = self.vision(pixel_values=pixel_values).last_hidden_state  # (B, 1 + N, Dv)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image)
        cls = text.last_hidden_state[:, 0, :]  # (B, Dt)
        return self.head(cls.to(self.head.layers[0].weight.dtype))


def build_model(cfg: dict, meta: bool = False) -> ImageRewardModel:
    """The architecture of ``config.json``; ``meta=True``: parameters on the meta device (no memory)."""
    if not meta:
        return ImageRewardModel(cfg)
    with torch.device("meta"):
        return ImageRewardModel(cfg)


def read_config(model_dir: Path) -> dict:
    """``model_dir/config.json``, checked to be ours."""
    path = model_dir / "config.json"
    hint = "write it with: python -m flowcredit.rewards.imagereward_convert (docs/rewards.md)"
    if not path.is_file():
        raise PathError(MODEL_DIR, model_dir, f"has no config.json; {hint}")
    with reading(MODEL_DIR, model_dir, "config.json"):
        cfg = json.loads(path.read_text())
    if not isinstance(cfg, dict) or cfg.get("format") != CONFIG_FORMAT:
        raise PathError(MODEL_DIR, model_dir, f"its config.json is not a converted ImageReward one; {hint}")
    return cfg


def load_model(model_dir: Path, device: str, dtype: torch.dtype) -> tuple[ImageRewardModel, dict]:
    """The frozen model of ``model_dir`` on ``device``: encoders in ``dtype``, head in float32."""
    from safetensors.torch import load_file

    cfg = read_config(model_dir)
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise PathError(MODEL_DIR, model_dir, "has no model.safetensors")
    with reading(MODEL_DIR, model_dir, "model.safetensors"):
        model = build_model(cfg, meta=True)
        result = model.load_state_dict(load_file(str(weights)), strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise PathError(
            MODEL_DIR,
            model_dir,
            f"its model.safetensors does not match config.json: "
            f"missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}",
        )
    emb = model.text.embeddings  # its only buffer, not saved: rebuild it off the meta device
    emb.position_ids = torch.arange(emb.position_embeddings.num_embeddings).unsqueeze(0)
    model.vision.to(device=device, dtype=dtype)
    model.text.to(device=device, dtype=dtype)
    model.head.to(device=device, dtype=torch.float32)
    return model.eval().requires_grad_(False), cfg


@functools.lru_cache(maxsize=2)
def _loaded(model_dir: str, device: str, dtype: str):
    from transformers import AutoTokenizer

    path = Path(model_dir)
    model, cfg = load_model(path, device, _DTYPES[dtype])
    with reading(MODEL_DIR, model_dir, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) > cfg["text"]["vocab_size"]:
        raise PathError(
            MODEL_DIR,
            model_dir,
            f"its tokenizer has {len(tokenizer)} tokens, the text encoder {cfg['text']['vocab_size']}",
        )
    return model, tokenizer, cfg


def centre_crop_offsets(height: int, width: int, crop_height: int, crop_width: int) -> tuple[int, int]:
    """``(top, left)`` of torchvision's ``CenterCrop``: ``int(round((H - h) / 2.0))``, likewise for width.

    Source: ``center_crop`` in ``torchvision/transforms/functional.py``. Python's round takes halves to
    even, so an excess of 1, 3, 5, 7 gives 0, 2, 2, 4, where a floor (``CLIPImageProcessor``'s, and
    :func:`flowcredit.rewards.clip.preprocess`'s) gives 0, 1, 2, 3. An image smaller than the crop, which
    torchvision pads first, cannot occur after the shortest-edge resize and is not handled.
    """
    return int(round((height - crop_height) / 2.0)), int(round((width - crop_width) / 2.0))


def imagereward_preprocess(images: torch.Tensor, pre: dict) -> torch.Tensor:
    """``images (B, 3, H, W)`` in [0, 1] → ``pixel_values (B, 3, S, S)``, as ImageReward's ``_transform``.

    ImageReward (``ImageReward/ImageReward.py``): ``Resize(S, bicubic)`` of the shortest edge on the PIL
    image, ``CenterCrop(S)``, ``ToTensor``, ``Normalize`` (CLIP mean/std). The resize, clipping and
    normalisation are :func:`~flowcredit.rewards.clip.preprocess`'s (torch's bicubic, not PIL's: resampling
    differences remain); the crop uses :func:`centre_crop_offsets` (normalising is per pixel, so cropping
    after it is the same).
    """
    x = preprocess(images, {**pre, "do_crop": False})
    crop_h, crop_w = pre["crop"]
    top, left = centre_crop_offsets(*x.shape[-2:], crop_h, crop_w)
    return x[..., top : top + crop_h, left : left + crop_w]


def image_config(cfg: dict) -> dict:
    """:func:`imagereward_preprocess` settings: shortest edge → S (bicubic), crop S×S."""
    size = int(cfg["vision"]["image_size"])
    return {
        "resize": size,
        "crop": (size, size),
        "do_crop": True,
        "mode": "bicubic",
        "mean": cfg["image_mean"],
        "std": cfg["image_std"],
    }


def imagereward(*, model_dir, device=None, dtype="float32", batch_size: int = 32):
    """ImageReward v1.0: ``(head(BLIP(image, prompt)[CLS]) − mean) / std`` → ``(B,)`` (module docstring).

    ``model_dir``: a directory written by ``python -m flowcredit.rewards.imagereward_convert``.
    """
    path = _existing(NAME, "model_dir", model_dir, want_dir=True)
    check_dtype(NAME, dtype)
    device = device or str(default_device())  # cuda:LOCAL_RANK: one GPU per rank
    model, tokenizer, cfg = _loaded(str(path.resolve()), device, dtype)
    pre, run_dtype = image_config(cfg), _DTYPES[dtype]
    mean, std, max_length = float(cfg["mean"]), float(cfg["std"]), int(cfg["max_length"])

    @torch.no_grad()
    def one(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = imagereward_preprocess(images.to(device), pre).to(run_dtype)
        tok = tokenizer(
            prompts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt"
        )
        raw = model(pixels, tok["input_ids"].to(device), tok["attention_mask"].to(device))
        return (raw.float() - mean) / std

    return batched_reward(one, batch_size, model)
