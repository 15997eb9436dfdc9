"""LoRA composed into the weight inside the forward: ``y = op(x, W + s·B·A)`` — one convolution or
matmul per layer instead of peft's three (``op(x, W) + s·B(A(x))``), and still differentiable in
``A`` and ``B``.

Equal to peft's forward up to float round-off (``(W + sBA)x`` vs ``Wx + s·B(Ax)``: about 1e-7
relative in float32; tests/test_lora_compose.py). On the built-in model's small layers, where
peft's three calls and their Python overhead dominate, one skill iteration takes 0.73× the time
(rollout 0.6×, update 0.78×; benchmarks/speed/throughput.py). It costs one weight-sized gradient per layer
in the backward (``dW' = dy·xᵀ``, from which ``dA`` and ``dB`` follow), which on large layers is a
full matmul that peft's forward avoids; so ``lora_forward="auto"`` composes on the built-in model
only. A layer with LoRA disabled (the reference policy) or merged runs its base layer, as peft does.

Sampling needs no gradient, so there the composed weight can be computed once per rollout instead of
once per call (:func:`sampling_copies`): every LoRA layer runs one matmul with a copy of ``W + s·B·A``,
the base weights are never written (they stay bit-identical, unlike a merge and unmerge, which leave
round-off: 4.7e-4 in bfloat16), at the memory of one copy of the LoRA'd weights.
"""

from __future__ import annotations

import contextlib
import types
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from flowcredit.errors import ConfigError
from flowcredit.run.sharding import is_sharded

if TYPE_CHECKING:
    from flowcredit.config import Config
    from flowcredit.models import FlowModel


def composed_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float):
    """``W + s·B·A`` for a Linear (``A (r, in)``, ``B (out, r)``) or a Conv2d (``A (r, in, kh, kw)``,
    ``B (out, r, 1, 1)``), in ``weight``'s shape and dtype."""
    delta = (lora_b.flatten(1) @ lora_a.flatten(1)).view(weight.shape)  # (out, in·kh·kw) → W's shape
    return weight + (scale * delta).to(weight.dtype)


def composed_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a peft ``LoraLayer`` (bound as its method) with one active adapter."""
    base = self.base_layer
    if self.disable_adapters or self.merged:
        return base(x)
    name = self.active_adapters[0]
    weight = composed_weight(
        base.weight, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]
    )
    x = x.to(weight.dtype)
    if isinstance(base, nn.Conv2d):
        return F.conv2d(x, weight, base.bias, base.stride, base.padding, base.dilation, base.groups)
    return F.linear(x, weight, base.bias)


def compose_lora(net: nn.Module) -> int:
    """Give every peft LoRA layer of ``net`` the composed forward; returns how many. Layers whose
    LoRA this cannot compose (dropout, DoRA, several adapters, sharded weights, other layer types)
    raise ``ValueError`` naming the layer."""
    count = 0
    for name, layer in lora_layers(net):
        if not composable(layer):
            raise ValueError(f"lora_forward='composed': cannot compose the LoRA of layer {name!r}")
        layer.forward = types.MethodType(composed_forward, layer)
        count += 1
    return count


def lora_layers(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every peft ``LoraLayer`` of ``net``."""
    from peft.tuners.lora import LoraLayer

    return [(name, m) for name, m in net.named_modules() if isinstance(m, LoraLayer)]


def composable(layer) -> bool:
    """Whether ``W + s·B·A`` is the layer's LoRA: a Linear or Conv2d base, one adapter, no DoRA, no
    dropout, weights not sharded (FSDP)."""
    ok = isinstance(layer.base_layer, (nn.Linear, nn.Conv2d)) and len(layer.lora_A) == 1
    ok = ok and not any(layer.use_dora.values()) and not is_sharded(layer.base_layer.weight)
    return ok and all(isinstance(d, nn.Identity) for d in layer.lora_dropout.values())


def copy_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a LoRA layer inside :func:`sampling_copies`: one op with the stored copy of
    ``W + s·B·A``; sampling only (no gradient reaches A and B through a copy)."""
    if torch.is_grad_enabled():
        raise RuntimeError("a sampling copy of the LoRA weights ran under gradient (sampling only)")
    base, weight = self.base_layer, self._sampling_weight
    x = x.to(weight.dtype)
    if isinstance(base, nn.Conv2d):
        return F.conv2d(x, weight, base.bias, base.stride, base.padding, base.dilation, base.groups)
    return F.linear(x, weight, base.bias)


@contextlib.contextmanager
def sampling_copies(net: nn.Module):
    """Inside: every composable, active LoRA layer of ``net`` runs :func:`copy_forward` with
    ``W + s·B·A`` computed once on entry (:func:`composed_weight`, the composed forward's own
    function, so a composed run samples the same numbers). On exit the layers get their forward back
    and the copies are freed; the base weights are never written. Yields the number of layers."""
    layers = []
    with torch.no_grad():
        for _, layer in lora_layers(net):
            if not composable(layer) or layer.disable_adapters or layer.merged:
                continue
            name = layer.active_adapters[0]
            a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
            layers.append((layer, layer.__dict__.get("forward")))
            layer._sampling_weight = composed_weight(layer.base_layer.weight, a, b, layer.scaling[name])
            layer.forward = types.MethodType(copy_forward, layer)
    try:
        yield len(layers)
    finally:
        for layer, forward in layers:
            del layer._sampling_weight
            if forward is None:
                del layer.forward  # peft's class forward again
            else:
                layer.forward = forward


def lora_forwards(cfg: Config, model: FlowModel, sharded: bool) -> tuple[bool, bool]:
    """``(composed, sampling_copies)``: whether the LoRA layers run composed under gradient
    (:func:`lora_composed`), and whether the rollout runs them on a copy of ``W + s·B·A`` computed
    once per rollout (:func:`flowcredit.run.lora_compose.sampling_copies`). ``lora_forward``:
    ``"peft"`` neither; ``"composed"`` both (the copy holds the composed forward's own weight: the
    same numbers); ``"peft+copy"`` the copy only; ``"auto"``: ``"composed"`` on an adapter that
    asks for it (``compose_lora = True``: the built-in model), ``"peft+copy"`` on the others when
    they compute in float32, ``"peft"`` when they compute in bfloat16 or float16 (weights or
    ``autocast``): a copy rounded to 16 bits moves the sampled log-probabilities by more than
    Flow-GRPO's clip range (first ratio 1 ± 2.1e-4 in bfloat16 against ± 1.2e-7 in float32,
    docs/benchmarks.md). Never on FSDP shards (peft's forward there)."""
    composed = lora_composed(cfg, model, sharded)
    if "lora" not in cfg.train_params or cfg.lora_forward == "peft" or sharded:
        return composed, False
    if cfg.lora_forward == "auto" and not composed:
        wide = getattr(model, "dtype", torch.float32) == torch.float32 and not cfg.autocast
        return composed, wide
    return composed, True


def lora_composed(cfg: Config, model: FlowModel, sharded: bool) -> bool:
    """Whether the LoRA layers run composed (:mod:`flowcredit.run.lora_compose`): ``lora_forward``
    ``"composed"``, or ``"auto"`` on an adapter that asks for it (``compose_lora = True``: the built-in
    model); never on FSDP shards."""
    if "lora" not in cfg.train_params or cfg.lora_forward in ("peft", "peft+copy"):
        return False
    if cfg.lora_forward == "composed" and sharded:
        raise ConfigError("lora_forward", "'composed' cannot run on FSDP shards: use 'peft' or 'auto'")
    return not sharded and (cfg.lora_forward == "composed" or getattr(model, "compose_lora", False))
