"""ShapeEval: procedural shape images, captions with structured metadata and an exact reward.

See ``docs/shapeeval.md``. Submodules: ``scene`` (palette, shapes, layout, rendering), ``prompts``
(captions, metadata, split, JSONL) and ``reward`` (the scorer). Names are re-exported lazily, so that
``python -m flowcredit.tasks.shapes.prompts`` runs cleanly; nothing here imports torch.
"""

import importlib

_EXPORTS = {
    "scene": (
        "BACKGROUND",
        "PALETTE",
        "SHAPES",
        "RELATIONS",
        "render_prompt",
        "render_scene",
        "sample_scene",
    ),
    "prompts": (
        "CATEGORIES",
        "VOCAB",
        "all_prompts",
        "caption",
        "confirmation_prompts",
        "load_prompts",
        "make_meta",
        "random_batch",
        "split_of",
        "validate_meta",
    ),
    "reward": (
        "detect_objects",
        "evaluation_table",
        "format_table",
        "score_images",
        "shapes_reward",
        "shapes_strict_reward",
    ),
}
_MODULE_OF = {name: mod for mod, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)


def __dir__() -> list[str]:
    return __all__
