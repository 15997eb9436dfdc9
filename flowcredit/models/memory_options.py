"""What the memory plan can change on a diffusers adapter (issue 57; docs/gpu.md, "Will it fit?"):
where the text encoders live, how many rows the VAE decodes at once, and an 8-bit frozen base.

- ``text_encoders`` (:data:`TEXT_PLACEMENTS`): ``"device"`` keeps them beside the transformer (the
  default, today's behaviour); ``"offload"`` keeps them on the host and moves them to the device for each
  encoding of prompts not yet encoded; ``"cpu"`` encodes on the host. Off the device, encodings are
  cached per prompt on the host (:class:`EncodingCache`, up to :data:`CACHE_BYTES`) and moved to the
  device when used, so a prompt seen before costs neither an encoding nor a move of the encoders.
- ``decode_chunk``: rows per VAE decode (the adapter's ``decode_chunk``; images are the same up to the
  convolutions' batch-size rounding, checked in tests/test_memory_options.py).
- ``base_quantization`` (:data:`BASE_QUANTIZATIONS`): the frozen Linear weights of the transformer's
  blocks stored in 8 bits through torchao (``float8``: e4m3 with a scale per output row; ``int8``: the
  same with int8), before LoRA is added, which trains in float32 on top. It changes the numbers (the
  base's outputs move by the rounding of its weights), so it is never a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flowcredit.errors import ConfigError

TEXT_PLACEMENTS = ("device", "offload", "cpu")
BASE_QUANTIZATIONS = ("none", "float8", "int8")
CACHE_BYTES = 2 * 2**30
"""The per-prompt encoding cache's bound in host memory (least recently used entries go first)."""
QUANTIZED_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.", "blocks.")
"""Linear layers under these names are quantised (the transformer's blocks, > 99 % of its weights);
embeddings, the time and text projections and the output layer stay in ``dtype``."""


def text_encoder_modules(pipe) -> list[nn.Module]:
    """The pipeline's text encoders (components named ``text_encoder*``)."""
    comps = getattr(pipe, "components", {}) or {}
    return [m for name, m in comps.items() if name.startswith("text_encoder") and isinstance(m, nn.Module)]


def move_tensors(obj, device):
    """``obj`` (a tensor, list, tuple, dict or dataclass of them: any adapter's encoding) with every tensor
    on ``device``; the structure is rebuilt, the host copy left as it was."""
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_tensors(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: move_tensors(v, device) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: move_tensors(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    return obj


def tensor_bytes(obj) -> int:
    """Bytes of every tensor in ``obj`` (as :func:`move_tensors` walks it)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


class EncodingCache:
    """Host-side encodings per prompt (per prompt list for encodings that cannot be split into rows),
    least recently used first out once their bytes pass ``max_bytes``.

    Rows are split and joined with the encoding type's ``rows`` / ``cat_rows`` (``PromptCond``: SD3,
    FLUX.1, Wan); a type without them (Qwen-Image pads to the longest prompt, Z-Image keeps lists) is
    cached whole, keyed by the prompt list. A row encoded in another batch can differ from the batched
    encoding in the last bits (the matmuls' batch-size rounding); tests/test_memory_options.py bounds it.
    """

    def __init__(self, max_bytes: int = CACHE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[object, object] = OrderedDict()
        self.null = None
        self.bytes = 0

    def _put(self, key, value) -> None:
        self.entries[key] = value
        self.bytes += tensor_bytes(value)
        while self.bytes > self.max_bytes and len(self.entries) > 1:
            _, old = self.entries.popitem(last=False)
            self.bytes -= tensor_bytes(old)

    def _get(self, key):
        self.entries.move_to_end(key)
        return self.entries[key]

    def encode(self, prompts: list[str], encode_fn):
        """The host encoding of ``prompts``, calling ``encode_fn(list)`` (host tensors) for those missing."""
        whole = tuple(prompts)
        if ("list", whole) in self.entries:
            return self._get(("list", whole))
        missing = list(dict.fromkeys(p for p in prompts if p not in self.entries))
        if missing:
            fresh = encode_fn(missing)
            if not hasattr(type(fresh), "cat_rows"):  # not splittable into rows: cache the list
                self._put(("list", whole), fresh if missing == list(prompts) else encode_fn(list(prompts)))
                return self.entries[("list", whole)]
            self.null = getattr(fresh, "null", None) if self.null is None else self.null
            for i, p in enumerate(missing):
                self._put(p, fresh.rows(i))
        rows = [self._get(p) for p in prompts]
        return type(rows[0]).cat_rows(rows, self.null)


@contextlib.contextmanager
def modules_on(modules: list[nn.Module], device, home):
    """``modules`` on ``device`` for the block, back on ``home`` after it (also on an error)."""
    for m in modules:
        m.to(device)
    try:
        yield
    finally:
        for m in modules:
            m.to(home)


def check_memory_options(cfg, model) -> None:
    """The fields of this module against ``model``: one error naming the field."""
    name = type(model).__name__
    if cfg.text_encoders not in TEXT_PLACEMENTS:
        raise ConfigError("text_encoders", f"{cfg.text_encoders!r}: one of {TEXT_PLACEMENTS}")
    if cfg.base_quantization not in BASE_QUANTIZATIONS:
        raise ConfigError("base_quantization", f"{cfg.base_quantization!r}: one of {BASE_QUANTIZATIONS}")
    if cfg.text_encoders != "device" and not hasattr(model, "set_text_placement"):
        problem = f"the {name} adapter has no separate text encoders to place (its network holds its own)"
        raise ConfigError("text_encoders", f"{cfg.text_encoders!r}, but {problem}")
    if cfg.decode_chunk < 0 or (cfg.decode_chunk and not hasattr(model, "decode_chunk")):
        problem = "must be ≥ 0" if cfg.decode_chunk < 0 else f"the {name} adapter decodes in one call"
        raise ConfigError("decode_chunk", f"{cfg.decode_chunk}: {problem}")
    if cfg.base_quantization != "none" and not hasattr(model, "pipe"):
        problem = f"needs a diffusers adapter, not {name}"
        raise ConfigError("base_quantization", f"{cfg.base_quantization!r} {problem}")


def apply_memory_options(cfg, model) -> None:
    """Set ``cfg``'s text placement, decode chunk and base quantisation on ``model`` (before LoRA)."""
    check_memory_options(cfg, model)
    if cfg.text_encoders != getattr(model, "text_placement", "device"):
        model.set_text_placement(cfg.text_encoders)
    if cfg.decode_chunk:
        model.decode_chunk = cfg.decode_chunk
    if cfg.base_quantization != "none":
        quantize_base(model.net, cfg.base_quantization)


def quantize_base(net: nn.Module, kind: str) -> int:
    """Store the Linear weights of ``net``'s blocks (:data:`QUANTIZED_BLOCKS`) in 8 bits with torchao's
    weight-only configs (``float8``: ``Float8WeightOnlyConfig``, ``int8``: ``Int8WeightOnlyConfig``);
    returns how many layers changed. Needs ``pip install 'flowcredit[quant]'`` (torchao)."""
    try:
        import torchao.quantization as tq
    except ImportError as exc:
        raise ConfigError(
            "base_quantization", f"{kind!r} needs torchao: pip install 'flowcredit[quant]' ({exc})"
        ) from exc
    config = {"float8": tq.Float8WeightOnlyConfig, "int8": tq.Int8WeightOnlyConfig}[kind]()
    linears = ((n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear))
    blocks = {n: m for n, m in linears if n.startswith(QUANTIZED_BLOCKS)}
    chosen = {n for n, m in blocks.items() if not is_traceable_wrapper_subclass(m.weight)}  # not yet 8-bit
    if blocks and not chosen:  # done already (the loader quantised before the move to the device)
        return 0
    if not chosen:
        raise ConfigError("base_quantization", f"{kind!r}: {type(net).__name__} has no Linear under "
                          f"{QUANTIZED_BLOCKS}")  # fmt: skip
    tq.quantize_(net, config, filter_fn=lambda m, fqn: fqn in chosen)
    return len(chosen)
