"""What trains and what it is compared to: trainable parameter sets, LoRA (peft), the reference
policy for the KL term, and an EMA of the trainable weights.

``train_params``: ``"lora"`` (LoRA on the velocity network, text encoder frozen), ``"text"`` (the text
encoder only), ``"lora+text"``, or ``"all"`` (full fine-tuning). The reference policy is the same
network with LoRA disabled when only LoRA trains, otherwise a frozen copy of the initial network.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flowcredit.errors import ConfigError, UserError
from flowcredit.run.sharding import is_sharded, shard_like


def lora_target_names(net: nn.Module, targets: str) -> list[str]:
    """Module names for LoRA, from a comma list: an entry that names one of ``net``'s direct children
    (the tiny model's ``unet`` or ``text``) selects that child, if it is a Linear/Conv2d, and every
    Linear/Conv2d under it; any other entry is a name suffix matched against the Linear/Conv2d
    modules. Raises if nothing matches."""
    layers = [n for n, m in net.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    children = {name for name, _ in net.named_children()}
    wanted = [t.strip() for t in targets.split(",") if t.strip()]
    chosen = [t for t in wanted if t in children]  # whole top-level modules
    prefixes = tuple(t + "." for t in chosen)
    suffixes = [t for t in wanted if t not in children]
    names = [
        n
        for n in layers
        if n in chosen or n.startswith(prefixes) or any(n == t or n.endswith("." + t) for t in suffixes)
    ]
    if not names:
        raise ConfigError("lora_targets", f"{targets!r} matches no Linear/Conv2d module")
    return names


class Policy:
    """Wraps a model adapter's ``net``: sets ``requires_grad``, adds LoRA, runs the reference policy."""

    def __init__(
        self,
        model,
        train_params: str,
        lora_rank: int = 4,
        lora_alpha: float = 4.0,
        lora_targets: str = "unet",
        need_reference: bool = False,
        seed: int = 0,
    ):
        self.model, self.train_params = model, train_params
        net = model.net
        net.requires_grad_(False)
        self.lora_names: list[str] = []
        self.frozen_net: nn.Module | None = None
        if need_reference and train_params != "lora":
            self.frozen_net = copy.deepcopy(net).requires_grad_(False)
        if "lora" in train_params:
            self._add_lora(net, lora_rank, lora_alpha, lora_targets, seed)
        if train_params in ("text", "lora+text"):
            if not hasattr(net, "text"):
                raise ConfigError(
                    "train_params",
                    f"{train_params!r} needs a model with a trainable text encoder module 'net.text' "
                    "(the built-in tiny model)",
                )
            net.text.requires_grad_(True)
        if train_params == "all":
            net.requires_grad_(True)

    def _add_lora(self, net, rank, alpha, targets, seed):
        from peft import LoraConfig, inject_adapter_in_model

        if targets == "default":
            targets = self.model.default_lora_targets
            if targets is None:
                raise ConfigError(
                    "lora_targets", f"{type(self.model).__name__} has no default LoRA targets: name them"
                )
        self.lora_names = lora_target_names(net, targets)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=self.lora_names, init_lora_weights="gaussian"
        )
        with torch.random.fork_rng(devices=[]):  # peft draws lora_A from the global RNG
            torch.manual_seed(seed)
            inject_adapter_in_model(config, net)
        for name, p in net.named_parameters():
            p.requires_grad_("lora_" in name)
            if "lora_" in name:  # AdamW on bf16/fp16 LoRA weights loses updates: keep them fp32
                p.data = p.data.float()

    def parameters(self) -> list[nn.Parameter]:
        return [p for p in self.model.net.parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name → tensor of every trainable parameter (what a checkpoint stores)."""
        return {n: p.detach().clone() for n, p in self.model.net.named_parameters() if p.requires_grad}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.model.net.named_parameters())
        missing = [n for n, p in params.items() if p.requires_grad and n not in state]
        if missing:
            raise UserError(f"checkpoint lacks trainable parameters {missing[:3]}… (different train_params?)")
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(shard_like(value, params[name]))  # FSDP: this rank's shard

    @contextmanager
    def reference(self):
        """Run the reference policy inside this context (LoRA disabled, or the frozen copy swapped in)."""
        if self.frozen_net is not None:
            live, self.model.net = self.model.net, self.frozen_net
            try:
                yield
            finally:
                self.model.net = live
            return
        layers = self._lora_layers()
        for layer in layers:
            layer.enable_adapters(False)
        try:
            yield
        finally:
            for layer in layers:
                layer.enable_adapters(True)

    @contextmanager
    def merged(self):
        """Run the current policy with LoRA merged into the base weights (no-grad use only).

        A merged layer is one plain convolution / matmul instead of three, about 1.6× faster here for
        value completions and evaluation. On exit the base weights are restored bit for bit from a
        copy (unmerging alone would leave round-off), so rollouts and updates, which run unmerged,
        see exactly the weights they saw before. Training parameters other than LoRA, or a sharded
        network (FSDP2: peft cannot merge into ``DTensor`` shards): no-op, the layers run unmerged; so
        do layers over an 8-bit base (``base_quantization``: a merge would round the LoRA into 8 bits).
        """
        layers = [m for m in self._lora_layers() if hasattr(m, "base_layer")]
        if any(is_sharded(m.base_layer.weight) for m in layers):
            yield
            return
        layers = [m for m in layers if not is_traceable_wrapper_subclass(m.base_layer.weight)]
        backups = [m.base_layer.weight.detach().clone() for m in layers]
        with torch.no_grad():
            for m in layers:
                m.merge()
        try:
            yield
        finally:
            with torch.no_grad():
                for m, weight in zip(layers, backups):
                    m.unmerge()
                    m.base_layer.weight.copy_(weight)

    def _lora_layers(self):
        if not self.lora_names:
            return []
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.model.net.modules() if isinstance(m, BaseTunerLayer)]

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """Plain weights of the current policy (LoRA merged in), loadable by the adapter's ``load``."""
        net = copy.deepcopy(self.model.net)
        for module in net.modules():
            if hasattr(module, "merge") and hasattr(module, "base_layer"):
                module.merge()
        out = {}
        for name, value in net.state_dict().items():
            if "lora_" in name:
                continue
            out[name.replace(".base_layer.", ".")] = value.detach().cpu().contiguous()
        return out


def apply_trained(model, trained: Path) -> None:
    """Merge a run's trained tensors (``trained/trainable.safetensors``: its LoRA, or whatever its
    ``train_params`` trained) into ``model``'s base weights in place, as the run's own export merged
    them; the run's ``config.json`` one level up names the LoRA (rank, alpha, targets, seed). What a
    published run keeps instead of its whole exported checkpoint (about 270 KB on the built-in model)."""
    import json

    from safetensors.torch import load_file

    run_cfg = json.loads((Path(trained).parent / "config.json").read_text())
    keys = ("train_params", "lora_rank", "lora_alpha", "lora_targets")
    policy = Policy(model, *(run_cfg[k] for k in keys), seed=run_cfg["seed"])
    policy.load_trainable_state(load_file(str(Path(trained) / "trainable.safetensors")))
    merged = policy.merged_state_dict()
    model.net = type(model)(model.config).net
    model.net.load_state_dict(merged)
    model.net.requires_grad_(False)


class EMA:
    """Exponential moving average of the trainable parameters, swapped in for evaluation."""

    def __init__(self, params: list[nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params):
            s.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)

    @contextmanager
    def applied(self):
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)
