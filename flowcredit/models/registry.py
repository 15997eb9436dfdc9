"""Model adapters by name, or by import path ``pkg.mod:load`` (the same convention as rewards).

A loader is ``load(cfg: Config) -> FlowModel``; it is imported only when chosen, so a diffusers model
costs nothing until used.
"""

from __future__ import annotations

import importlib

from flowcredit.errors import ConfigError, UserError, one_line
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

VIDEO_MODELS = ("wan",)
"""The built-in adapters that make video, the ones ``num_frames`` applies to (:func:`makes_video`)."""


def makes_video(model: FlowModel) -> bool:
    """Whether an adapter makes video clips: its ``latent_shape`` is ``(C, F, H, W)`` (``protocol.py``)."""
    return len(model.latent_shape) == 4


def check_num_frames(num_frames: int, model_name: str, video: bool) -> None:
    """Refuse a clip length for an adapter that makes images (``num_frames`` would be ignored)."""
    if num_frames and not video:
        raise ConfigError(
            "num_frames",
            f"{num_frames} frames, but {model_name!r} makes images, not video; leave num_frames at 0 "
            f"(only a video model such as {', '.join(map(repr, VIDEO_MODELS))} takes it)",
        )


def is_model_spec(spec: str) -> bool:
    """A registered name or a ``pkg.mod:fn`` import path."""
    module, sep, fn = spec.partition(":")
    return spec in MODELS or bool(sep and module and fn)


def apply_text_length(cfg, model) -> None:
    """``cfg.max_sequence_length`` onto ``model``: > 0 sets the adapter's text length (an adapter without
    one, such as the built-in tiny model, raises); 0 requires the adapter's default, so that a length
    set from Python (``SD3FlowModel(pipe, max_sequence_length=128)`` given to ``build_session``) cannot
    run unrecorded: the run's ``config.json`` names every text length it used."""
    n = getattr(cfg, "max_sequence_length", 0)
    name = type(model).__name__
    if not hasattr(model, "set_max_sequence_length"):
        if n:
            raise ConfigError(
                "max_sequence_length", f"{n}, but the {name} adapter has no text length to set; leave it 0"
            )
        return
    if n:
        model.set_max_sequence_length(n)
        return
    default = model.default_max_sequence_length()
    if model.max_sequence_length != default:
        raise ConfigError(
            "max_sequence_length",
            f"0 (the {name} default, {default}), but the model given encodes {model.max_sequence_length} "
            f"tokens: set max_sequence_length={model.max_sequence_length} so that config.json records it",
        )


def _call_loader(loader, cfg) -> FlowModel:
    """``loader(cfg)``; a file it cannot read (``OSError``, a corrupt safetensors file), even in a
    loader outside this package, is one :class:`ConfigError` naming ``checkpoint`` (the built-in
    loaders name the file themselves, with :func:`flowcredit.errors.reading`)."""
    from safetensors import SafetensorError

    try:
        return loader(cfg)
    except UserError:
        raise
    except (OSError, SafetensorError) as exc:
        problem = f"{cfg.checkpoint!r}: the {cfg.model!r} loader cannot read it ({one_line(exc)})"
        raise ConfigError("checkpoint", problem) from exc


CUDA_INSTALL = (
    "install a CUDA build of the same torch into the venv, e.g. `.venv/bin/pip install torch=={version} "
    "--index-url https://download.pytorch.org/whl/cu130` (the tag of your CUDA driver; docs/gpu.md)"
)


def check_device(device: str) -> None:
    """A ``cuda`` device on a torch without CUDA (the CPU wheel ``make`` installs, or no GPU) is one
    :class:`ConfigError` naming ``device`` and how to get a CUDA build, not torch's traceback."""
    import torch

    if not str(device).startswith("cuda") or torch.cuda.is_available():
        return
    version = torch.__version__.split("+")[0]
    if torch.version.cuda is None:
        problem = f"{device!r}: this torch ({torch.__version__}) has no CUDA; " + CUDA_INSTALL.format(
            version=version
        )
    else:
        problem = f"{device!r}: torch {torch.__version__} finds no CUDA GPU (driver, CUDA_VISIBLE_DEVICES?)"
    raise ConfigError("device", problem)


def load_model(cfg) -> FlowModel:
    """The adapter named by ``cfg.model`` (a name of :data:`MODELS` or ``pkg.mod:fn``), checked
    against the :class:`FlowModel` contract; ``cfg.guidance_scale`` > 0 overrides the model's."""
    check_device(cfg.device)
    target = MODELS.get(cfg.model, cfg.model)
    module, _, name = target.partition(":")
    try:
        loader = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("model", f"cannot import {target!r}: {exc}") from exc
    model = _call_loader(loader, cfg)
    check_adapter(model, cfg.model)
    check_num_frames(getattr(cfg, "num_frames", 0), cfg.model, makes_video(model))  # pkg.mod:load ones
    if cfg.guidance_scale > 0:  # 0: the documented "keep the model's default"
        model.guidance_scale = cfg.guidance_scale
    apply_text_length(cfg, model)
    from flowcredit.models.memory_options import apply_memory_options

    apply_memory_options(cfg, model)  # the placement, decode chunk and quantisation the config names
    if cfg.autocast:
        if not hasattr(model, "autocast"):
            raise ConfigError("autocast", f"the {cfg.model!r} adapter has no autocast switch; see 'dtype'")
        model.autocast = True  # this run only: the exported checkpoint keeps the base's setting
    return model
