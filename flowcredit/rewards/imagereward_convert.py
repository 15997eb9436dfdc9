"""One-off conversion of the released ImageReward checkpoint to a ``model_dir`` for ``imagereward``.

The release (``ImageReward.pt``, THUDM/ImageReward v1.0) is the ``state_dict`` of ``ImageReward``:
``blip.visual_encoder.*`` (BLIP's timm-style ViT), ``blip.text_encoder.*`` (BLIP's ``med.py``
BertModel with cross-attention, no pooler), ``blip.vision_proj`` / ``blip.text_proj`` (unused by the
score) and ``mlp.layers.{0,2,4,6,7}`` (its ``nn.Sequential``: Linear, Dropout, Linear, Dropout, Linear,
Dropout, Linear, Linear). Every tensor maps one to one onto ``transformers``' BLIP modules:

    visual_encoder.cls_token                → vision.embeddings.class_embedding
    visual_encoder.pos_embed                → vision.embeddings.position_embedding
    visual_encoder.patch_embed.proj.*       → vision.embeddings.patch_embedding.*
    visual_encoder.blocks.N.norm1/norm2.*   → vision.encoder.layers.N.layer_norm1/layer_norm2.*
    visual_encoder.blocks.N.attn.qkv.*      → vision.encoder.layers.N.self_attn.qkv.*  (fused q, k, v)
    visual_encoder.blocks.N.attn.proj.*     → vision.encoder.layers.N.self_attn.projection.*
    visual_encoder.blocks.N.mlp.fc1/fc2.*   → vision.encoder.layers.N.mlp.fc1/fc2.*
    visual_encoder.norm.*                   → vision.post_layernorm.*
    text_encoder.<name>                     → text.<name>  (same BERT names, crossattention included)
    mlp.layers.<k-th index>.*               → head.layers.<k>.*

Dropped: ``blip.vision_proj.*``, ``blip.text_proj.*`` (ITC projections) and
``blip.text_encoder.embeddings.position_ids`` (a buffer ``arange(512)``, rebuilt at load). Any other
key, or a key the architecture needs that is absent, is an error naming it. This module is the only
place a ``.pt`` file is read, with ``torch.load(..., weights_only=True)`` (no code is unpickled).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

from flowcredit.errors import UserError
from flowcredit.rewards.clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from flowcredit.rewards.imagereward import (
    CONFIG_FORMAT,
    IMAGEREWARD_MEAN,
    IMAGEREWARD_STD,
    MAX_LENGTH,
    build_model,
)

VISION, TEXT, HEAD = "blip.visual_encoder.", "blip.text_encoder.", "mlp.layers."
DROPPED = ("blip.vision_proj.", "blip.text_proj.", "blip.text_encoder.embeddings.position_ids")
_VISION_RULES = [  # (ours, released) after the prefixes
    (r"embeddings\.class_embedding", "cls_token"),
    (r"embeddings\.position_embedding", "pos_embed"),
    (r"embeddings\.patch_embedding\.(\w+)", r"patch_embed.proj.\1"),
    (r"encoder\.layers\.(\d+)\.layer_norm1\.(\w+)", r"blocks.\1.norm1.\2"),
    (r"encoder\.layers\.(\d+)\.layer_norm2\.(\w+)", r"blocks.\1.norm2.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.qkv\.(\w+)", r"blocks.\1.attn.qkv.\2"),
    (r"encoder\.layers\.(\d+)\.self_attn\.projection\.(\w+)", r"blocks.\1.attn.proj.\2"),
    (r"encoder\.layers\.(\d+)\.mlp\.(fc[12])\.(\w+)", r"blocks.\1.mlp.\2.\3"),
    (r"post_layernorm\.(\w+)", r"norm.\1"),
]


def released_key(ours: str, head_indices: list[int]) -> str:
    """The released name of our key ``ours`` (``head_indices``: the released ``mlp.layers`` indices)."""
    part, _, rest = ours.partition(".")
    if part == "text":
        return TEXT + rest
    if part == "head":
        k, _, param = rest.removeprefix("layers.").partition(".")
        return f"{HEAD}{head_indices[int(k)]}.{param}"
    for pattern, template in _VISION_RULES:
        if re.fullmatch(pattern, rest):
            return VISION + re.sub(pattern, template, rest)
    raise AssertionError(f"no released name for {ours!r}")


def _count(sd: dict, pattern: str) -> int:
    """How many distinct ``N`` fill ``pattern`` (one ``(\\d+)`` group) among the keys of ``sd``."""
    return len({m.group(1) for k in sd if (m := re.fullmatch(pattern, k))})


def _need(sd: dict, key: str) -> torch.Tensor:
    if key not in sd:
        raise UserError(f"ImageReward checkpoint: missing key {key!r}")
    return sd[key]


def _heads(option: str, width: int, given: int | None) -> int:
    heads = given if given is not None else width // 64
    if heads < 1 or width % heads:
        raise UserError(f"ImageReward checkpoint: option {option!r} = {heads} does not divide width {width}")
    return heads


def infer_config(sd: dict, vision_heads: int | None = None, text_heads: int | None = None) -> dict:
    """Architecture sizes read off the released tensors' shapes (heads: given, or width / 64)."""
    width = _need(sd, VISION + "cls_token").shape[-1]
    patch = _need(sd, VISION + "patch_embed.proj.weight").shape[-1]
    grid = round((_need(sd, VISION + "pos_embed").shape[1] - 1) ** 0.5)
    words = _need(sd, TEXT + "embeddings.word_embeddings.weight")
    heads_idx = sorted(int(k.split(".")[2]) for k in sd if re.fullmatch(r"mlp\.layers\.\d+\.weight", k))
    if not heads_idx:
        raise UserError("ImageReward checkpoint: missing key 'mlp.layers.0.weight' (no head layers)")
    head_dims = [sd[f"{HEAD}{heads_idx[0]}.weight"].shape[1]]
    head_dims += [sd[f"{HEAD}{i}.weight"].shape[0] for i in heads_idx]
    if head_dims[0] != words.shape[1] or head_dims[-1] != 1:
        raise UserError(
            f"ImageReward checkpoint: head 'mlp.layers' maps {head_dims}, not {words.shape[1]} → 1"
        )
    return {
        "format": CONFIG_FORMAT,
        "vision": {
            "hidden_size": width,
            "intermediate_size": _need(sd, VISION + "blocks.0.mlp.fc1.weight").shape[0],
            "num_hidden_layers": _count(sd, r"blip\.visual_encoder\.blocks\.(\d+)\..*"),
            "num_attention_heads": _heads("--vision-heads", width, vision_heads),
            "image_size": grid * patch,
            "patch_size": patch,
            "layer_norm_eps": 1e-6,  # BLIP vit.py: partial(nn.LayerNorm, eps=1e-6)
        },
        "text": {
            "vocab_size": words.shape[0],
            "hidden_size": words.shape[1],
            "intermediate_size": _need(sd, TEXT + "encoder.layer.0.intermediate.dense.weight").shape[0],
            "num_hidden_layers": _count(sd, r"blip\.text_encoder\.encoder\.layer\.(\d+)\..*"),
            "num_attention_heads": _heads("--text-heads", words.shape[1], text_heads),
            "max_position_embeddings": _need(sd, TEXT + "embeddings.position_embeddings.weight").shape[0],
            "layer_norm_eps": 1e-12,  # BLIP med_config.json
            "pad_token_id": 0,
        },
        "head_dims": head_dims,
        "head_indices": heads_idx,
        "mean": IMAGEREWARD_MEAN,
        "std": IMAGEREWARD_STD,
        "max_length": MAX_LENGTH,
        "image_mean": list(OPENAI_CLIP_MEAN),
        "image_std": list(OPENAI_CLIP_STD),
    }


def convert_state_dict(sd: dict, vision_heads=None, text_heads=None) -> tuple[dict, dict, list[str]]:
    """Released ``sd`` → ``(our tensors, config, dropped keys)``; unknown/missing keys are errors."""
    bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise UserError(f"ImageReward checkpoint: keys {bad[:5]} do not hold tensors (not a state dict?)")
    cfg = infer_config(sd, vision_heads, text_heads)
    names = {released_key(k, cfg["head_indices"]): k for k in build_model(cfg, meta=True).state_dict()}
    names.pop(TEXT + "embeddings.position_ids", None)  # a buffer; not a weight
    dropped = sorted(k for k in sd if k.startswith(DROPPED))
    unknown = sorted(set(sd) - set(names) - set(dropped))
    missing = sorted(set(names) - set(sd))
    if unknown:
        raise UserError(f"ImageReward checkpoint: unknown keys {unknown[:10]} ({len(unknown)} in all)")
    if missing:
        raise UserError(f"ImageReward checkpoint: missing keys {missing[:10]} ({len(missing)} in all)")
    model = build_model(cfg, meta=True).state_dict()
    out = {}
    for released, ours in names.items():
        if tuple(sd[released].shape) != tuple(model[ours].shape):
            raise UserError(
                f"ImageReward checkpoint: key {released!r} has shape {tuple(sd[released].shape)}, "
                f"the architecture needs {tuple(model[ours].shape)}"
            )
        out[ours] = sd[released].detach().to(torch.float32).contiguous()
    return out, cfg, dropped


def save_tokenizer(tokenizer_dir, out: Path, vocab_size: int) -> None:
    """BLIP's tokenizer: bert-base-uncased plus ``[DEC]`` (bos) and ``[ENC]``, saved into ``out``."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"option '--tokenizer' = {str(tokenizer_dir)!r} is not an existing directory")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) != vocab_size:
        raise UserError(
            f"tokenizer {str(path)!r}: {len(tokenizer)} tokens with [DEC] and [ENC], but the checkpoint's "
            f"word embeddings have {vocab_size} rows (BLIP: bert-base-uncased, 30522 + 2)"
        )
    tokenizer.model_max_length = MAX_LENGTH
    tokenizer.save_pretrained(out)


def convert(checkpoint, tokenizer_dir, out, vision_heads=None, text_heads=None) -> str:
    """Write ``out/model.safetensors``, ``out/config.json`` and the tokenizer; returns a report."""
    from safetensors.torch import save_file

    ckpt = Path(checkpoint)
    if not ckpt.is_file():
        raise FileNotFoundError(f"option '--checkpoint' = {str(checkpoint)!r} is not an existing file")
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise UserError(f"ImageReward checkpoint {str(ckpt)!r} is a {type(sd).__name__}, not a state dict")
    tensors, cfg, dropped = convert_state_dict(sd, vision_heads, text_heads)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer_dir, out, cfg["text"]["vocab_size"])
    save_file(tensors, str(out / "model.safetensors"))
    cfg["source"] = {"checkpoint": ckpt.name, "dropped": dropped}
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return (
        f"wrote {out}: model.safetensors ({len(tensors)} tensors), config.json, tokenizer; "
        f"dropped {len(dropped)} keys not used by the score: {dropped}"
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m flowcredit.rewards.imagereward_convert convert --checkpoint PT --tokenizer DIR …``"""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flowcredit.rewards.imagereward_convert")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="released ImageReward.pt + bert-base-uncased tokenizer → model_dir")
    c.add_argument("--checkpoint", required=True, help="the released ImageReward.pt (a state dict)")
    c.add_argument("--tokenizer", required=True, help="a directory with the bert-base-uncased tokenizer")
    c.add_argument("--out", required=True, help="the model_dir to write")
    c.add_argument("--vision-heads", type=int, default=None, help="default: vision width / 64 (16 for ViT-L)")
    c.add_argument("--text-heads", type=int, default=None, help="default: text width / 64 (12 for BERT-base)")
    args = parser.parse_args(argv)
    try:
        report = convert(args.checkpoint, args.tokenizer, args.out, args.vision_heads, args.text_heads)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
