"""CLIP-based rewards from local weight directories: ``pickscore``, ``clipscore``, ``aesthetic``,
``clip_product_head`` (an ImageReward-*style* head on CLIP features, not ImageReward: that is
``imagereward``, flowcredit/rewards/imagereward.py).

Every factory takes ``model_dir``: a directory written by ``CLIPModel.save_pretrained`` plus its
tokenizer (``tokenizer.save_pretrained``) and, optionally, ``preprocessor_config.json`` (without it:
CLIP's defaults at the model's image size). Nothing is ever downloaded. Images are preprocessed in
torch, differentiably and without torchvision: resize (the processor's ``size``, bicubic with
antialiasing), centre crop (``crop_size``), normalise (``image_mean``/``image_std``). With
``e_img``, ``e_txt`` the L2-normalised projected embeddings:

- ``pickscore``: ``logit_scale.exp() · cos(e_img, e_txt) / divisor`` (PickScore; Flow-GRPO uses divisor 26).
- ``clipscore``: ``weight · max(cos(e_img, e_txt), 0)`` with ``weight = 2.5`` (Hessel et al. 2021; their
  ``prefix`` is ``"A photo depicts "``, ours defaults to none).
- ``aesthetic``: ``head(e_img)``; ``head`` is a stack of linear layers in a safetensors file, applied in
  key order without activations: exactly the LAION aesthetic predictor v2 MLP (its ReLUs are commented
  out, its Dropouts are identity at eval) once converted from ``.pth`` (docs/rewards.md).
- ``clip_product_head``: ``(head(e_img ⊙ e_txt) − mean) / std``. ImageReward proper is a BLIP model whose
  text encoder cross-attends to the image before its MLP head (the ``imagereward`` reward); here the
  elementwise product of CLIP embeddings stands in for that fused feature (an all-ones head gives the
  cosine). ImageReward's weights do not load into it; it is for a head you trained on CLIP features.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from flowcredit.errors import PathError, UserError, existing, reading
from flowcredit.models.diffusers_common import default_device

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def option(reward: str, name: str) -> str:
    """How an error names a reward's option: ``reward 'pickscore': option 'model_dir'``."""
    return f"reward {reward!r}: option {name!r}"


def _existing(reward: str, name: str, path, want_dir: bool) -> Path:
    """``path`` if it exists; a one-line :class:`~flowcredit.errors.PathError` naming the option otherwise."""
    hint = "weights are never downloaded; save them there first, see docs/rewards.md"
    return existing(option(reward, name), path, "directory" if want_dir else "file", hint)


def check_dtype(reward: str, dtype: str) -> None:
    """A ``dtype`` option outside :data:`_DTYPES` is a :class:`~flowcredit.errors.UserError` naming it."""
    if dtype not in _DTYPES:
        raise UserError(f"{option(reward, 'dtype')} must be one of {sorted(_DTYPES)}, got {dtype!r}")


def _size_hw(size, fallback: int) -> tuple[int, int] | int:
    """Processor ``size``/``crop_size`` → ``(h, w)``, or an int shortest edge."""
    if size is None:
        return fallback
    if isinstance(size, int):
        return size
    if "shortest_edge" in size:
        return int(size["shortest_edge"])
    return int(size["height"]), int(size["width"])


def _preprocess_config(model_dir: Path, image_size: int) -> dict:
    path = model_dir / "preprocessor_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    crop = _size_hw(cfg.get("crop_size"), image_size)
    return {
        "resize": _size_hw(cfg.get("size"), image_size) if cfg.get("do_resize", True) else None,
        "crop": (crop, crop) if isinstance(crop, int) else crop,
        "do_crop": cfg.get("do_center_crop", True),
        "mode": "bilinear" if cfg.get("resample", 3) == 2 else "bicubic",
        "mean": cfg.get("image_mean", OPENAI_CLIP_MEAN) if cfg.get("do_normalize", True) else (0.0,) * 3,
        "std": cfg.get("image_std", OPENAI_CLIP_STD) if cfg.get("do_normalize", True) else (1.0,) * 3,
    }


def preprocess(images: torch.Tensor, cfg: dict) -> torch.Tensor:
    """``images (B, 3, H, W)`` in [0, 1] → CLIP ``pixel_values (B, 3, h, w)``, as CLIPImageProcessor does."""
    x = images.float()
    if cfg["resize"] is not None:
        h, w = x.shape[-2:]
        if isinstance(cfg["resize"], int):  # shortest edge, aspect kept
            s = cfg["resize"]
            size = (s, int(s * w / h)) if h <= w else (int(s * h / w), s)
        else:
            size = cfg["resize"]
        if tuple(size) != (h, w):
            x = F.interpolate(x, size=size, mode=cfg["mode"], align_corners=False, antialias=True)
        x = x.clamp(0, 1)  # bicubic overshoots; the PIL path clips at uint8
    if cfg["do_crop"]:
        ch, cw = cfg["crop"]
        h, w = x.shape[-2:]
        top, left = max((h - ch) // 2, 0), max((w - cw) // 2, 0)
        x = x[..., top : top + ch, left : left + cw]
    mean = torch.tensor(cfg["mean"], device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(cfg["std"], device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


class ClipBundle:
    """A frozen CLIP model, its tokenizer and preprocessing, on one device."""

    def __init__(self, model_dir: Path, reward: str, device: str, dtype: torch.dtype):
        from transformers import AutoTokenizer, CLIPModel

        with reading(option(reward, "model_dir"), model_dir):  # not a CLIP model: one line naming it
            self.model = CLIPModel.from_pretrained(model_dir, dtype=dtype).eval().requires_grad_(False)
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            cfg = self.model.config
            self.pre = _preprocess_config(model_dir, cfg.vision_config.image_size)
        self.model.to(device)
        self.max_length = min(self.tokenizer.model_max_length, cfg.text_config.max_position_embeddings)
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1], or a list of ``(3, h_i, w_i)`` each preprocessed alone (sizes may
        differ; GenEval's colour crops) → L2-normalised ``(B, D)`` float32, one forward."""
        if isinstance(images, torch.Tensor):
            pixels = preprocess(images.to(self.device), self.pre)
        else:
            pixels = torch.cat([preprocess(x[None].to(self.device), self.pre) for x in images])
        pooled = self.model.vision_model(pixel_values=pixels.to(self.dtype)).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """``B`` prompts → L2-normalised ``(B, D)`` float32 (truncated to the model's length)."""
        tok = self.tokenizer(
            prompts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        out = self.model.text_model(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
        )
        return F.normalize(self.model.text_projection(out.pooler_output).float(), dim=-1)


@functools.lru_cache(maxsize=4)
def _bundle(model_dir: str, reward: str, device: str, dtype: str) -> ClipBundle:
    return ClipBundle(Path(model_dir), reward, device, _DTYPES[dtype])


def load_clip(reward: str, model_dir, device: str | None, dtype: str) -> ClipBundle:
    """The cached :class:`ClipBundle` of ``model_dir``, with errors naming the reward and option."""
    path = _existing(reward, "model_dir", model_dir, want_dir=True)
    check_dtype(reward, dtype)
    device = device or str(default_device())  # cuda:LOCAL_RANK: one GPU per rank
    return _bundle(str(path.resolve()), reward, device, dtype)


def load_linear_head(reward: str, path, in_dim: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Linear layers ``[(W (out, in), b (out,) | None)]`` from a safetensors file, in natural key order.

    Keys are ``<prefix>.weight`` / ``<prefix>.bias`` (e.g. LAION's ``layers.0 … layers.7``); the
    first layer must take ``in_dim`` features and the last must output one.
    """
    from safetensors.torch import load_file

    file = _existing(reward, "head_path", path, want_dir=False)
    with reading(option(reward, "head_path"), path):
        tensors = load_file(str(file))
    prefixes = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight")}
    order = sorted(
        prefixes, key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.split(".")]
    )
    layers = [(tensors[p + ".weight"].float(), tensors.get(p + ".bias")) for p in order]
    dims = [in_dim] + [w.shape[0] for w, _ in layers]
    ok = bool(layers) and all(w.ndim == 2 and w.shape[1] == d for (w, _), d in zip(layers, dims))
    if not ok or dims[-1] != 1:
        shapes = [tuple(w.shape) for w, _ in layers]
        raise PathError(
            option(reward, "head_path"),
            path,
            f"must be linear layers from {in_dim} features to 1, got weight shapes {shapes}",
        )
    return [(w, None if b is None else b.float()) for w, b in layers]


def _apply_head(layers, x: torch.Tensor) -> torch.Tensor:
    """``x (B, D)`` → ``(B,)`` through the affine stack."""
    for w, b in layers:
        x = x @ w.to(x.device).T + (0 if b is None else b.to(x.device))
    return x.squeeze(-1)


def batched_reward(one, batch_size: int, *modules):
    """The reward function that scores ``batch_size`` images at a time with ``one(images, prompts)``;
    its ``modules`` attribute names its networks (the ``offload`` option moves them, rewards/__init__)."""

    def fn(images, prompts, metadata):
        return _batched(one, images, prompts, batch_size)

    fn.modules = list(modules)
    return fn


def _batched(fn, images: torch.Tensor, prompts: list[str], batch_size: int) -> torch.Tensor:
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    outs = [
        fn(images[i : i + batch_size], prompts[i : i + batch_size])
        for i in range(0, len(prompts), batch_size)
    ]
    return torch.cat(outs).float().cpu() if outs else torch.zeros(0)


def pickscore(*, model_dir, divisor: float = 1.0, device=None, dtype="float32", batch_size: int = 32):
    """PickScore: ``logit_scale.exp() · cos(e_img, e_txt) / divisor`` → ``(B,)``."""
    clip = load_clip("pickscore", model_dir, device, dtype)
    scale = clip.model.logit_scale.exp().float().item()

    def one(images, prompts):
        return scale * (clip.image_embeds(images) * clip.text_embeds(prompts)).sum(-1) / divisor

    return batched_reward(one, batch_size, clip.model)


def clipscore(
    *, model_dir, weight: float = 2.5, prefix: str = "", device=None, dtype="float32", batch_size=32
):
    """CLIPScore: ``weight · max(cos(e_img, e_txt(prefix + prompt)), 0)`` → ``(B,)``."""
    clip = load_clip("clipscore", model_dir, device, dtype)

    def one(images, prompts):
        cos = (clip.image_embeds(images) * clip.text_embeds([prefix + p for p in prompts])).sum(-1)
        return weight * cos.clamp(min=0)

    return batched_reward(one, batch_size, clip.model)


def aesthetic(*, model_dir, head_path=None, device=None, dtype="float32", batch_size: int = 32):
    """Aesthetic score ``head(e_img)`` → ``(B,)``.

    ``head_path`` defaults to ``model_dir/aesthetic_head.safetensors``.
    """
    clip = load_clip("aesthetic", model_dir, device, dtype)
    head_path = head_path if head_path is not None else Path(model_dir) / "aesthetic_head.safetensors"
    head = load_linear_head("aesthetic", head_path, clip.model.config.projection_dim)

    def one(images, prompts):
        return _apply_head(head, clip.image_embeds(images))

    return batched_reward(one, batch_size, clip.model)


def clip_product_head(
    *,
    model_dir,
    head_path=None,
    mean: float = 0.0,
    std: float = 1.0,
    device=None,
    dtype="float32",
    batch_size=32,
):
    """ImageReward-STYLE CLIP product head; not ImageReward (that is the ``imagereward`` reward).

    ``(head(e_img ⊙ e_txt) − mean) / std`` → ``(B,)`` (see the module docstring). ``head_path``
    defaults to ``model_dir/clip_product_head.safetensors``; pass your head's own ``mean``/``std``.
    """
    clip = load_clip("clip_product_head", model_dir, device, dtype)
    head_path = head_path if head_path is not None else Path(model_dir) / "clip_product_head.safetensors"
    head = load_linear_head("clip_product_head", head_path, clip.model.config.projection_dim)

    def one(images, prompts):
        return (_apply_head(head, clip.image_embeds(images) * clip.text_embeds(prompts)) - mean) / std

    return batched_reward(one, batch_size, clip.model)
