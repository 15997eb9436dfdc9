"""HPSv2 / HPSv2.1 reward (Wu et al. 2023, "Human Preference Score v2"): ``hps``.

HPS is an OpenCLIP ViT-H-14 fine-tuned on human preferences. Its score of (image, prompt) is the
cosine between the L2-normalised image and text embeddings: ``hpsv2``'s ``img_score.py`` takes the
diagonal of ``image_features @ text_features.T``, with neither the logit scale nor a factor 100.

- Weights: the released ``HPS_v2.1_compressed.pt`` is a pickle of ``{"state_dict": open_clip state
  dict}``. Convert it once, the only place a pickle is read (``torch.load``, ``weights_only=True``)::

      python -m flowcredit.rewards.hps convert --checkpoint HPS_v2.1_compressed.pt --out hps_v2.1.safetensors

  The reward loads only safetensors files of an open_clip state dict (the conversion keeps the keys).
- Model: open_clip's architecture ``model_name`` (default ``ViT-H-14``) as transformers' ``CLIPModel``,
  weights renamed strictly (flowcredit/rewards/open_clip_layout.py says why open_clip itself is not used).
- Tokens: open_clip's BPE vocabulary file ``bpe_path`` (default: the copy inside an installed open_clip).
- Pixels: HPSv2's scoring transform, a letterbox (long side to 224, black padding; not a crop), in torch
  on the float images (:func:`hps_preprocess`).
- Precision: HPSv2 scores under ``torch.cuda.amp.autocast()`` (float16 matmuls on CUDA, float32 weights);
  here the model runs in its ``dtype`` (default float32). HPSv2's benchmark reports 100 × this score.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pickle
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from flowcredit.errors import PathError, UserError, one_line, reading
from flowcredit.models.diffusers_common import default_device
from flowcredit.rewards.clip import (
    _DTYPES,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    _existing,
    batched_reward,
    check_dtype,
    option,
)
from flowcredit.rewards.open_clip_layout import (
    basic_clean,
    bpe_tokenizer,
    clip_config,
    default_bpe_path,
    model_config,
    to_hf_state_dict,
)

CONVERT = (
    "python -m flowcredit.rewards.hps convert --checkpoint HPS_v2.1_compressed.pt --out hps_v2.1.safetensors"
)


def letterbox_geometry(height: int, width: int, size: int) -> tuple[tuple[int, int], tuple[int, ...]]:
    """The resized ``(h, w)`` and padding ``(left, right, top, bottom)`` of HPSv2's ``ResizeMaxSize(size)``.

    ``hpsv2/src/open_clip/transform.py``: ``scale = size / float(max(H, W))``, each side ``round(side *
    scale)`` (Python's round, halves to even), then ``pad_h = size - h``, ``pad_w = size - w`` split as
    ``pad // 2`` before (top, left) and ``pad - pad // 2`` after: an odd padding puts the extra row or
    column at the bottom or right. Deviation: where ``max(H, W) == size`` the reference neither resizes
    nor pads, so a non-square image stays non-square (which ViT-H-14 cannot take); here it is padded.
    """
    scale = size / float(max(height, width))
    h, w = round(height * scale), round(width * scale)
    pad_h, pad_w = size - h, size - w
    return (h, w), (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)


def hps_preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """``images (B, 3, H, W)`` in [0, 1] → normalised ``(B, 3, size, size)``, as HPSv2 scores images.

    HPSv2's ``img_score.py`` (and its benchmark, ``evaluation.py``) build the transform with
    ``light_augmentation=True``, i.e. its open_clip copy's ``image_transform(..., is_train=False,
    resize_longest_max=True)``: ``ToTensor``, then ``ResizeMaxSize(size, fill=0)`` on that float tensor
    (torchvision's bicubic tensor resize: antialiased since torchvision 0.17, not clipped to [0, 1]) to
    :func:`letterbox_geometry`'s size, zero padding there (before normalisation, so a padded pixel is
    ``(0 − mean) / std``), then the OpenAI mean/std. Not open_clip's default shortest-edge resize and
    centre crop: a non-square image is scored whole, with black bars.
    """
    x = images.float()
    (h, w), padding = letterbox_geometry(*x.shape[-2:], size)
    if (h, w) != tuple(x.shape[-2:]):
        x = F.interpolate(x, size=(h, w), mode="bicubic", align_corners=False, antialias=True)
    x = F.pad(x, padding, value=0.0)
    mean = torch.tensor(OPENAI_CLIP_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_CLIP_STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors ``checkpoint``; anything else (a pickle) is a one-line
    :class:`~flowcredit.errors.PathError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        problem = f"not a safetensors file ({one_line(exc)}); convert the released .pt once: {CONVERT}"
        raise PathError(option("hps", "checkpoint"), path, problem) from exc


def _check_shapes(model: torch.nn.Module, weights: dict[str, torch.Tensor], name: str) -> None:
    """A weight whose shape differs from ``model_name``'s architecture is a ``UserError`` naming it."""
    target = model.state_dict()
    for key, value in weights.items():
        if tuple(value.shape) != tuple(target[key].shape):
            raise UserError(
                f"reward 'hps': weight {key!r} has shape {tuple(value.shape)}, model_name {name!r} "
                f"expects {tuple(target[key].shape)}"
            )


class HpsBundle:
    """A frozen HPS model (``CLIPModel``), its tokenizer and input sizes, on one device."""

    def __init__(self, checkpoint: Path, model_name: str, bpe_path: Path, device: str, dtype: torch.dtype):
        from transformers import CLIPModel

        cfg = model_config(model_name)
        self.context_length = cfg.get("text_cfg", {}).get("context_length", 77)
        self.image_size = cfg.get("vision_cfg", {}).get("image_size", 224)
        with reading(option("hps", "bpe_path"), bpe_path):
            self.tokenizer = bpe_tokenizer(bpe_path, self.context_length)
        config = clip_config(model_name, self.tokenizer.eos_token_id, self.tokenizer.bos_token_id)
        if len(self.tokenizer) != config.text_config.vocab_size:
            vocab = config.text_config.vocab_size
            problem = f"has {len(self.tokenizer)} tokens, model_name {model_name!r} {vocab}"
            raise PathError(option("hps", "bpe_path"), bpe_path, problem)
        with reading(option("hps", "checkpoint"), checkpoint):  # keys that are not model_name's
            weights = to_hf_state_dict(_read_safetensors(checkpoint), model_name)
        with torch.device(device):
            model = CLIPModel(config)
        _check_shapes(model, weights, model_name)
        model.load_state_dict(weights, strict=True)
        self.model = model.to(dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype

    @torch.no_grad()
    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` in [0, 1] → L2-normalised ``(B, D)`` float32."""
        pixels = hps_preprocess(images.to(self.device), self.image_size).to(self.dtype)
        pooled = self.model.vision_model(pixel_values=pixels).pooler_output
        return F.normalize(self.model.visual_projection(pooled).float(), dim=-1)

    @torch.no_grad()
    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        """``B`` prompts → L2-normalised ``(B, D)`` float32 (open_clip's clean-up; truncated as open_clip:
        the first ``context_length - 2`` tokens between start and end of text)."""
        tok = self.tokenizer(
            [basic_clean(p) for p in prompts],
            padding=True,
            truncation=True,
            max_length=self.context_length,
            split_special_tokens=True,  # "<|endoftext|>" typed in a prompt is text, as in open_clip
            return_tensors="pt",
        )
        out = self.model.text_model(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
        )
        return F.normalize(self.model.text_projection(out.pooler_output).float(), dim=-1)


@functools.lru_cache(maxsize=2)
def _bundle(checkpoint: str, model_name: str, config: str, bpe: str, device: str, dtype: str) -> HpsBundle:
    del config  # in the key only: a config registered again under the same name is a new model
    return HpsBundle(Path(checkpoint), model_name, Path(bpe), device, _DTYPES[dtype])


def load_hps(checkpoint, model_name: str, bpe_path, device: str | None, dtype: str) -> HpsBundle:
    """The cached :class:`HpsBundle`, with errors naming the option at fault."""
    path = _existing("hps", "checkpoint", checkpoint, want_dir=False)
    if importlib.util.find_spec("ftfy") is None:
        raise UserError("reward 'hps' needs ftfy (open_clip's text clean-up): pip install 'flowcredit[hps]'")
    if bpe_path is None and default_bpe_path() is None:
        raise UserError(
            f"{option('hps', 'bpe_path')} is not set and open_clip is not installed; pass the path of "
            "open_clip's bpe_simple_vocab_16e6.txt.gz (see docs/rewards.md)"
        )
    bpe = (
        _existing("hps", "bpe_path", bpe_path, want_dir=False) if bpe_path is not None else default_bpe_path()
    )
    check_dtype("hps", dtype)
    config = json.dumps(model_config(model_name), sort_keys=True)
    device = device or str(default_device())  # cuda:LOCAL_RANK: one GPU per rank
    return _bundle(str(path.resolve()), model_name, config, str(Path(bpe).resolve()), device, dtype)


def hps(*, checkpoint, model_name="ViT-H-14", bpe_path=None, device=None, dtype="float32", batch_size=32):
    """HPSv2(.1): ``cos(e_img, e_txt)`` of the HPS model in ``checkpoint`` (safetensors) → ``(B,)``."""
    bundle = load_hps(checkpoint, model_name, bpe_path, device, dtype)

    def one(images, prompts):
        return (bundle.image_embeds(images) * bundle.text_embeds(prompts)).sum(-1)

    return batched_reward(one, batch_size, bundle.model)


def read_released(path) -> dict[str, torch.Tensor]:
    """The open_clip state dict in a released ``.pt`` (``{"state_dict": ...}`` or bare; ``module.``
    prefixes of a DDP save removed), unpickled with ``weights_only=True``: tensors only, no code."""
    file = _existing("hps convert", "checkpoint", path, want_dir=False)
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # something besides tensors and plain containers
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{str(file)!r} is not loadable with weights_only=True: {first}") from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"{str(file)!r} holds no state dict (a dict of tensors, or one under 'state_dict')")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def convert(checkpoint, out, model_name: str = "ViT-H-14") -> Path:
    """Released ``.pt`` → safetensors of the same open_clip state dict, checked against ``model_name``."""
    from safetensors.torch import save_file

    state = read_released(checkpoint)
    to_hf_state_dict(state, model_name)  # every key expected, none left over
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in state.items() if k != "attn_mask"}, str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m flowcredit.rewards.hps convert --checkpoint X.pt --out Y.safetensors``."""
    parser = argparse.ArgumentParser(prog="python -m flowcredit.rewards.hps")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="released HPS .pt → safetensors (the reward's 'checkpoint')")
    conv.add_argument("--checkpoint", required=True, help="e.g. HPS_v2.1_compressed.pt")
    conv.add_argument("--out", required=True, help="e.g. hps_v2.1.safetensors")
    conv.add_argument("--model_name", default="ViT-H-14", help="open_clip architecture (default ViT-H-14)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.checkpoint, args.out, args.model_name)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
