"""Which diffusers pipeline a ``--checkpoint`` holds: a one-line :class:`ConfigError` for a path that
cannot be the adapter's pipeline (naming the ``--model`` that loads it), and the test for a diffusers
run's ``final/`` export (``flowcredit eval``/``sample`` load it on top of the run's base)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from flowcredit.errors import ConfigError, reading
from flowcredit.models.run_paths import is_run_dir, run_path_problem

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file name of an exported LoRA (diffusers' ``load_lora_weights`` default)."""

PIPELINE_MODELS = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "QwenImagePipeline": "qwen_image",
    "WanPipeline": "wan",
    "ZImagePipeline": "z_image",
}
"""The ``--model`` of each diffusers pipeline class an adapter loads."""


def is_run_final(checkpoint: str | Path | None) -> bool:
    """Whether ``checkpoint`` is a diffusers run's ``final/``: a LoRA or ``transformer/`` export beside
    ``trainable.safetensors``, with the run's ``config.json`` (which names the base) one level up."""
    if not checkpoint:
        return False
    final = Path(checkpoint)
    exported = (final / LORA_WEIGHTS).is_file() or (final / "transformer").is_dir()
    return (
        exported and (final / "trainable.safetensors").is_file() and (final.parent / "config.json").is_file()
    )


def check_checkpoint(checkpoint: str, pipeline_name: str) -> None:
    """Refuse, with a one-line :class:`ConfigError`, a ``checkpoint`` that cannot be this adapter's
    pipeline: a missing local path, a directory without ``model_index.json`` (e.g. a run's
    ``final/``), or another pipeline class (naming the ``--model`` that loads it). A string shaped
    like a hub id (``owner/name``) that is not a local path is left to ``from_pretrained``, unless it
    misspells a path in a run folder (``RUN/fina``)."""
    path = Path(checkpoint).expanduser()
    hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", checkpoint) is not None and not checkpoint.startswith(".")
    if not path.exists():
        problem = run_path_problem(checkpoint)  # a misspelt RUN/final is no hub id
        if problem or not hub_id:
            raise ConfigError(
                "checkpoint", problem or f"no such directory {checkpoint!r} (nor a hub id 'owner/name')"
            )
        return
    index = path / "model_index.json"
    if not index.is_file():
        hint = ""
        if is_run_final(path):
            hint = "; it is a run's final/: sample or evaluate it with 'flowcredit sample/eval --checkpoint'"
        elif is_run_dir(path):
            hint = f"; it is a run folder: sample or evaluate its final/ with --checkpoint {path / 'final'}"
        raise ConfigError(
            "checkpoint", f"{checkpoint!r} is not a diffusers pipeline (no model_index.json){hint}"
        )
    with reading("config field 'checkpoint'", checkpoint, "model_index.json"):
        found = json.loads(index.read_text()).get("_class_name")
    if found != pipeline_name:
        fix = (
            f"use --model {PIPELINE_MODELS[found]}"
            if found in PIPELINE_MODELS
            else "no built-in adapter loads it"
        )
        raise ConfigError(
            "checkpoint", f"{checkpoint!r} holds a {found}, not the {pipeline_name} this --model loads; {fix}"
        )
