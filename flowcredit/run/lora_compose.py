"""LoRA composed into the weight inside the forward: ``y = op(x, W + s·B·A)`` — one convolution or
matmul per layer instead of peft's three (``op(x, W) + s·B(A(x))``), and still differentiable in
``A`` and ``B``.

Equal to peft's forward up to float round-off (``(W + sBA)x`` vs ``Wx + s·B(Ax)``: about 1e-7
relative in float32; tests/test_lora_compose.py). On the built-in model's small layers, where
peft's three calls and their Python overhead dominate, one skill iteration takes 0.73× the time
(rollout 0.6×, update 0.78×; benchmarks/throughput.py). It costs one weight-sized gradient per layer
in the backward (``dW' = dy·xᵀ``, from which ``dA`` and ``dB`` follow), which on large layers is a
full matmul that peft's forward avoids; so ``lora_forward="auto"`` composes on the built-in model
only. A layer with LoRA disabled (the reference policy) or merged runs its base layer, as peft does.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from flowcredit.run.sharding import is_sharded


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
    from peft.tuners.lora import LoraLayer

    count = 0
    for name, layer in net.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        ok = isinstance(layer.base_layer, (nn.Linear, nn.Conv2d)) and len(layer.lora_A) == 1
        ok = ok and not any(layer.use_dora.values()) and not is_sharded(layer.base_layer.weight)
        ok = ok and all(isinstance(d, nn.Identity) for d in layer.lora_dropout.values())
        if not ok:
            raise ValueError(f"lora_forward='composed': cannot compose the LoRA of layer {name!r}")
        layer.forward = types.MethodType(composed_forward, layer)
        count += 1
    return count
