"""Model adapters by name, or by import path ``pkg.mod:load`` (the same convention as rewards).

A loader is ``load(cfg: Config) -> FlowModel``; it is imported only when chosen, so a diffusers model
costs nothing until used.
"""

from __future__ import annotations

import importlib

from flowcredit.errors import ConfigError
from flowcredit.models.protocol import FlowModel, check_adapter

MODELS: dict[str, str] = {
    "tiny": "flowcredit.models.tiny:load_for_training",
    "sd3": "flowcredit.models.sd3:load_for_training",
    "flux": "flowcredit.models.flux:load_for_training",
    "qwen_image": "flowcredit.models.qwen_image:load_for_training",
    "wan": "flowcredit.models.wan:load_for_training",
    "z_image": "flowcredit.models.z_image:load_for_training",
}
"""Built-in adapters: ``name -> "module:loader"``."""


def is_model_spec(spec: str) -> bool:
    """A registered name or a ``pkg.mod:fn`` import path."""
    module, sep, fn = spec.partition(":")
    return spec in MODELS or bool(sep and module and fn)


def load_model(cfg) -> FlowModel:
    """The adapter named by ``cfg.model`` (a name of :data:`MODELS` or ``pkg.mod:fn``), checked
    against the :class:`FlowModel` contract; ``cfg.guidance_scale`` > 0 overrides the model's."""
    target = MODELS.get(cfg.model, cfg.model)
    module, _, name = target.partition(":")
    try:
        loader = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("model", f"cannot import {target!r}: {exc}") from exc
    model = loader(cfg)
    check_adapter(model, cfg.model)
    if cfg.guidance_scale > 0:  # 0: the documented "keep the model's default"
        model.guidance_scale = cfg.guidance_scale
    if cfg.autocast:
        if not hasattr(model, "autocast"):
            raise ConfigError("autocast", f"the {cfg.model!r} adapter has no autocast switch; see 'dtype'")
        model.autocast = True  # this run only: the exported checkpoint keeps the base's setting
    return model
