"""OpenCLIP ViT checkpoints in transformers' ``CLIPModel``, without importing open_clip.

open_clip needs torchvision at import time, and no torchvision wheel from PyPI imports beside the CPU
build of torch this project pins; transformers' ``CLIPModel`` is the same architecture (a ViT with a
class token, pre-LayerNorm blocks, GELU MLPs, a causal text transformer pooled at the end-of-text
token), so an open_clip state dict is renamed onto it here:

- :data:`MODEL_CONFIGS` holds open_clip model configs (its ``model_configs/*.json`` format);
  :func:`add_model_config` registers more (tests use a tiny one).
- :func:`clip_config` turns one into a ``CLIPConfig``; :func:`to_hf_state_dict` renames the weights,
  strictly: a missing or unexpected key is a ``ValueError`` naming it.
- :func:`bpe_tokenizer` builds the tokenizer from open_clip's ``bpe_simple_vocab_16e6.txt.gz``
  (same vocabulary, ids and merges as open_clip's ``SimpleTokenizer``); :func:`basic_clean` is its text
  clean-up (ftfy, HTML unescaping) that transformers' tokenizer does not do.
"""

from __future__ import annotations

import gzip
import html
import importlib.util
import json
from pathlib import Path

import torch

MODEL_CONFIGS: dict[str, dict] = {
    "ViT-H-14": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
    },
}
"""open_clip model configs by name (``ViT-H-14`` as in open_clip 2.x and 3.x)."""

# open_clip's defaults (CLIPVisionCfg / CLIPTextCfg) for the fields this loader reads
_VISION = {
    "image_size": 224,
    "layers": 12,
    "width": 768,
    "head_width": 64,
    "patch_size": 16,
    "mlp_ratio": 4.0,
}
_TEXT = {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12, "mlp_ratio": 4.0}
# other fields are accepted only at these values (the plain ViT / text transformer above)
_AT_DEFAULT = {
    "ls_init_value": None,
    "attentional_pool": False,
    "no_ln_pre": False,
    "final_ln_after_pool": False,
    "pos_embed_type": "learnable",
    "embed_cls": False,
    "no_causal_mask": False,
    "proj_bias": False,
    "proj_type": "linear",
    "output_tokens": False,
    "act_kwargs": None,
    "norm_kwargs": None,
}
_TRAINING_ONLY = {"patch_dropout", "pad_id", "eos_id"}  # no effect on this pooling at eval
_POOL = {"vision_cfg": "tok", "text_cfg": "argmax"}  # class token; the end-of-text token
BPE_FILE = "bpe_simple_vocab_16e6.txt.gz"


def add_model_config(name: str, config: dict | str | Path) -> None:
    """Register an open_clip model config (a dict, or a path to its JSON file) under ``name``."""
    if not isinstance(config, dict):
        config = json.loads(Path(config).read_text())
    MODEL_CONFIGS[name] = json.loads(json.dumps(config))  # a private copy


def model_config(name: str) -> dict:
    """The registered config ``name``; ``ValueError`` listing the known ones otherwise."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"unknown open_clip model_name {name!r}; known: {sorted(MODEL_CONFIGS)}")
    return MODEL_CONFIGS[name]


def _fields(name: str, part: str, cfg: dict, defaults: dict) -> dict:
    """``cfg``'s fields over ``defaults``; a field this loader cannot honour is a ``ValueError``."""
    for key, value in cfg.items():
        fixed = {**_AT_DEFAULT, "pool_type": _POOL[part]}
        ok = key in defaults or key in _TRAINING_ONLY or (key in fixed and value == fixed[key])
        if not ok:
            raise ValueError(f"open_clip model {name!r}: {part}.{key} = {value!r} is not supported")
    return {**defaults, **{k: cfg[k] for k in defaults if k in cfg}}


def clip_config(name: str, eos_token_id: int, bos_token_id: int):
    """``transformers.CLIPConfig`` for the open_clip model config ``name``."""
    from transformers import CLIPConfig

    cfg = model_config(name)
    for key in cfg:
        if key not in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu"):
            raise ValueError(f"open_clip model {name!r}: {key!r} is not supported")
    v = _fields(name, "vision_cfg", cfg.get("vision_cfg", {}), _VISION)
    t = _fields(name, "text_cfg", cfg.get("text_cfg", {}), _TEXT)
    act = "quick_gelu" if cfg.get("quick_gelu", False) else "gelu"
    vision = dict(
        hidden_size=v["width"],
        intermediate_size=int(v["width"] * v["mlp_ratio"]),
        num_hidden_layers=v["layers"],
        num_attention_heads=v["width"] // v["head_width"],
        image_size=v["image_size"],
        patch_size=v["patch_size"],
        hidden_act=act,
    )
    text = dict(
        vocab_size=t["vocab_size"],
        hidden_size=t["width"],
        intermediate_size=int(t["width"] * t["mlp_ratio"]),
        num_hidden_layers=t["layers"],
        num_attention_heads=t["heads"],
        max_position_embeddings=t["context_length"],
        hidden_act=act,
        eos_token_id=eos_token_id,  # pooled at the first end-of-text token, as open_clip's argmax
        bos_token_id=bos_token_id,
        pad_token_id=eos_token_id,
    )
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=cfg["embed_dim"])


def _block(take, src: str, dst: str, out: dict) -> None:
    """One residual block: open_clip ``src`` (nn.MultiheadAttention's packed q,k,v) → HF ``dst``."""
    w, b = take(f"{src}.attn.in_proj_weight"), take(f"{src}.attn.in_proj_bias")
    for proj, wi, bi in zip(("q_proj", "k_proj", "v_proj"), w.chunk(3), b.chunk(3)):
        out[f"{dst}.self_attn.{proj}.weight"], out[f"{dst}.self_attn.{proj}.bias"] = wi, bi
    pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2"}
    pairs |= {"mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
    for a, h in pairs.items():
        for p in ("weight", "bias"):
            out[f"{dst}.{h}.{p}"] = take(f"{src}.{a}.{p}")


def _layer_norm(take, src: str, dst: str, out: dict) -> None:
    out[f"{dst}.weight"], out[f"{dst}.bias"] = take(f"{src}.weight"), take(f"{src}.bias")


def to_hf_state_dict(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """Rename an open_clip state dict of model ``name`` to ``CLIPModel``'s keys.

    Every key is used exactly once: a missing one, or one left over, is a ``ValueError`` naming it.
    ``attn_mask`` (the causal mask, a buffer rebuilt at load) is dropped if present.
    """
    cfg = model_config(name)
    left = {k: v for k, v in state.items() if k != "attn_mask"}

    def take(key):
        if key not in left:
            raise ValueError(f"open_clip state dict for {name!r} is missing key {key!r}")
        return left.pop(key)

    out = {"logit_scale": take("logit_scale")}
    out["vision_model.embeddings.class_embedding"] = take("visual.class_embedding")
    out["vision_model.embeddings.patch_embedding.weight"] = take("visual.conv1.weight")
    out["vision_model.embeddings.position_embedding.weight"] = take("visual.positional_embedding")
    _layer_norm(take, "visual.ln_pre", "vision_model.pre_layrnorm", out)
    for i in range(cfg.get("vision_cfg", {}).get("layers", _VISION["layers"])):
        _block(take, f"visual.transformer.resblocks.{i}", f"vision_model.encoder.layers.{i}", out)
    _layer_norm(take, "visual.ln_post", "vision_model.post_layernorm", out)
    out["visual_projection.weight"] = take("visual.proj").T  # open_clip: x @ proj
    out["text_model.embeddings.token_embedding.weight"] = take("token_embedding.weight")
    out["text_model.embeddings.position_embedding.weight"] = take("positional_embedding")
    for i in range(cfg.get("text_cfg", {}).get("layers", _TEXT["layers"])):
        _block(take, f"transformer.resblocks.{i}", f"text_model.encoder.layers.{i}", out)
    _layer_norm(take, "ln_final", "text_model.final_layer_norm", out)
    out["text_projection.weight"] = take("text_projection").T
    if left:
        raise ValueError(f"open_clip state dict for {name!r} has unexpected key {sorted(left)[0]!r}")
    return out


def _byte_chars() -> list[str]:
    """The 256 printable stand-ins for bytes of byte-level BPE (GPT-2's table), in vocabulary order:
    the bytes that print as themselves, then the others (bytes 0–32, 127–160, 173) as chr(256 + n)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in kept]
    return [chr(b) for b in kept] + [chr(256 + n) for n in range(len(others))]


def default_bpe_path() -> Path | None:
    """open_clip's vocabulary file, if open_clip is installed (found without importing it)."""
    spec = importlib.util.find_spec("open_clip")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / BPE_FILE).is_file():
            return Path(folder) / BPE_FILE
    return None


def bpe_tokenizer(bpe_path: Path, context_length: int):
    """``transformers.CLIPTokenizer`` with open_clip's vocabulary: bytes, bytes + ``</w>``, one token per
    merge (at most 48,894, as open_clip reads), then start- and end-of-text (ids 49406, 49407 in full)."""
    from transformers import CLIPTokenizer

    lines = gzip.open(bpe_path).read().decode("utf-8").split("\n")
    merges = [tuple(m.split()) for m in lines[1 : 49152 - 256 - 2 + 1] if m.strip()]
    chars = _byte_chars()
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"BPE file {str(bpe_path)!r} has duplicate merges")
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=context_length)


def basic_clean(text: str) -> str:
    """open_clip's clean-up before tokenising: ftfy's ``fix_text``, HTML unescaped twice, stripped
    (the tokenizer then collapses whitespace and lower-cases, as open_clip does)."""
    import ftfy

    return html.unescape(html.unescape(ftfy.fix_text(text))).strip()
