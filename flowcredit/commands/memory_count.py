"""Counting memory on any tensors, real or fake (`flowcredit memory`, its plan in memory_plan.py):
the live storages ops create (:class:`LiveStorages`), the bytes of a set of tensors, and what autograd
saves for the backward (:func:`saved_for_backward`)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


class LiveStorages(TorchDispatchMode):
    """Counts the bytes of the storages that ops create inside the mode while anything references them.

    Storages alive when the mode starts (``ignore``: the weights) are never counted, even when an op
    returns a view of them. ``current`` and ``peak`` are in bytes; ``kernels`` holds the names of the
    attention ops dispatched. Works on real and fake tensors alike.
    """

    def __init__(self, ignore: set[int] = frozenset()):
        super().__init__()
        self.ignore, self.live, self.current, self.peak = set(ignore), {}, 0, 0
        self.kernels: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__
        if "attention" in name or name.startswith("_softmax"):
            self.kernels.add(name.split(".")[0])
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                for storage in storages(t):
                    self._track(storage)
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self.live or key in self.ignore:
            return
        self.live[key] = n = storage.nbytes()
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current


def storages(t: torch.Tensor):
    """The storages holding ``t``'s data: its own, or its inner tensors' for a wrapper subclass (torchao's
    8-bit weights: the 8-bit data and the scales)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from storages(getattr(t, name))
    else:
        yield t.untyped_storage()


def storage_keys(*objects) -> set[int]:
    """The storage keys of every tensor among ``objects`` (modules: parameters and buffers)."""
    return {st._cdata for t in _tensors(objects) for st in storages(t)}


def storage_bytes(*objects) -> int:
    """Bytes of the distinct storages of every tensor among ``objects``."""
    seen = {}
    for t in _tensors(objects):
        for st in storages(t):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _tensors(objects):
    for obj in objects:
        if isinstance(obj, nn.Module):
            yield from obj.parameters()
            yield from obj.buffers()
        elif isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            yield from _tensors(obj.values())
        elif isinstance(obj, (list, tuple)):
            yield from _tensors(obj)


@contextlib.contextmanager
def saved_for_backward(weights: set[int]):
    """Collects ``{storage key: bytes}`` of the tensors autograd saves for the backward (weights
    excluded); ``square`` holds those of shape ``(…, N, N)``, N ≥ 64: attention probabilities."""
    saved, square = {}, {}

    def pack(t):
        for st in storages(t):
            if st._cdata not in weights:
                saved[st._cdata] = st.nbytes()
                if t.dim() >= 3 and t.shape[-1] == t.shape[-2] >= 64:
                    square[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved, square
