"""Atomic, pickle-free checkpoints: safetensors for tensors, JSON for everything else.

A checkpoint is a directory ``RUN/checkpoint`` written as ``RUN/checkpoint.tmp`` and swapped in by
renames (the previous one survives as ``checkpoint.old`` until the new one is in place), so a run
killed at any moment leaves a complete checkpoint. Random state needs no saving: every generator
is re-seeded from ``(seed, iteration, purpose)`` at the start of each iteration.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def flatten_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """``optimizer.state_dict()`` → (tensors, JSON-able rest)."""
    tensors, scalars = {}, {}
    for pid, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for flat, value in list(tensors.items()) + list(meta["scalars"].items()):
        pid, key = flat.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(
    run_dir: Path,
    *,
    iteration: int,
    trainable: dict,
    optimizer: dict,
    ema: dict | None,
    extra: dict,
    old: dict | None = None,
    name: str = "checkpoint",
) -> Path:
    """Write ``run_dir/<name>`` atomically and return its path (``old``: the old policy of a
    forward-process update rule, beside the EMA)."""
    tmp = fresh_dir(Path(run_dir) / f"{name}.tmp")
    save_file({k: v.cpu().contiguous() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
    opt_tensors, opt_meta = flatten_optimizer(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    for kind, shadow in (("ema", ema), ("old", old)):
        if shadow is not None:
            save_file({k: v.cpu().contiguous() for k, v in shadow.items()}, str(tmp / f"{kind}.safetensors"))
    meta = {"iteration": iteration, "optimizer": opt_meta, **extra}
    (tmp / "state.json").write_text(json.dumps(meta, indent=1))
    return swap_in(tmp, Path(run_dir) / name)


def fresh_dir(tmp: Path) -> Path:
    """``tmp`` made empty (a leftover of a write cut short is removed)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def swap_in(tmp: Path, final: Path) -> Path:
    """Replace folder ``final`` by the complete folder ``tmp`` (its files fsync'ed first) by renames:
    the previous one survives as ``<final>.old`` until the new one is in place."""
    _fsync_dir(tmp)
    previous = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(final, previous)
    os.replace(tmp, final)
    shutil.rmtree(previous, ignore_errors=True)
    return final


def _fsync_dir(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())


def find_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (``checkpoint``, else ``checkpoint.old``), or None."""
    for name in ("checkpoint", "checkpoint.old"):
        path = Path(run_dir) / name
        if (path / "state.json").is_file():
            return path
    return None


def load_checkpoint(path: Path) -> dict:
    """Inverse of :func:`save_checkpoint`: ``iteration, trainable, optimizer, ema, old, extra``."""
    meta = json.loads((path / "state.json").read_text())
    optimizer = unflatten_optimizer(load_file(str(path / "optimizer.safetensors")), meta.pop("optimizer"))
    ema_file, old_file = path / "ema.safetensors", path / "old.safetensors"
    return {
        "old": load_file(str(old_file)) if old_file.exists() else None,
        "iteration": meta.pop("iteration"),
        "trainable": load_file(str(path / "trainable.safetensors")),
        "optimizer": optimizer,
        "ema": load_file(str(ema_file)) if ema_file.exists() else None,
        "extra": meta,
    }
