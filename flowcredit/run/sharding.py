"""Full (unsharded) tensors of an FSDP2-sharded network, for the checkpoint, the EMA and the export.

Under FSDP2 (``fully_shard``, in place: parameter names do not change) each trained parameter is a
``DTensor`` whose rank-local part is one ``Shard(0)`` chunk, and so are the Adam moments and the EMA
shadows made from them. The files a run writes hold the full tensors under the names and keys of a
1-process run, so a sharded run's checkpoint resumes a 1-process run and vice versa:

- :func:`full` / :func:`full_dict` gather (``DTensor.full_tensor``, a collective: every rank calls it
  in the same order) and keep the result on rank 0 only, on the CPU;
- :func:`shard_like` cuts a full tensor into this rank's chunk of a sharded reference, without
  communication (every rank reads the checkpoint file);
- :func:`full_optimizer_state` / :func:`shard_optimizer_state` do the same to an optimizer state
  dict, which keeps its integer parameter ids (torch's DCP ``get_optimizer_state_dict`` would key it
  by parameter name, another file format);
- :func:`meta_twin` / :func:`gathered_twin`: a plain copy of the network on the ``meta`` device,
  filled on rank 0 with every gathered weight for the adapter's export (``save_final``).

On plain tensors every function is the identity (no copy, no collective).
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn


def is_sharded(tensor: torch.Tensor) -> bool:
    """A ``DTensor`` (checked without importing ``torch.distributed.tensor``, which takes a second:
    no tensor is one unless something imported it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def full(tensor: torch.Tensor) -> torch.Tensor | None:
    """The full tensor of a ``DTensor`` on rank 0 (CPU; ``None`` on other ranks), a plain one as is.
    Collective for a ``DTensor``: call it on every rank."""
    if not is_sharded(tensor):
        return tensor
    whole = tensor.detach().full_tensor()
    return whole.cpu() if _rank() == 0 else None


def full_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`full` of every value (same keys, same order); ``{}`` off rank 0 when anything is sharded."""
    out = {name: full(t) for name, t in tensors.items()}
    return {} if any(v is None for v in out.values()) else out


def shard_like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``value`` (the full tensor, on every rank) as ``ref``'s local shard: a ``DTensor`` on ``ref``'s
    mesh and placements, cut locally (``src_data_rank=None``: no broadcast). Plain ``ref``: ``value``."""
    if not is_sharded(ref):
        return value
    from torch.distributed.tensor import distribute_tensor

    value = value.to(device=ref.device, dtype=ref.dtype)
    return distribute_tensor(value, ref.device_mesh, ref.placements, src_data_rank=None)


def full_optimizer_state(state: dict) -> dict:
    """``optimizer.state_dict()`` with every sharded state tensor (Adam's moments) gathered: rank 0
    gets exactly a 1-process optimizer's state dict; other ranks get one without tensors."""
    gathered = {
        pid: {key: full(value) for key, value in entries.items()} for pid, entries in state["state"].items()
    }
    if _rank() != 0:
        gathered = {pid: {k: v for k, v in e.items() if v is not None} for pid, e in gathered.items()}
    return {"state": gathered, "param_groups": state["param_groups"]}


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """Inverse of :func:`full_optimizer_state`: a full state dict (integer ids in the order of
    ``optimizer.param_groups``) with each tensor shaped like its parameter cut like that parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for pid, entries in state["state"].items():
        p = params[int(pid)]
        out[pid] = {
            key: shard_like(v, p) if torch.is_tensor(v) and v.shape == p.shape else v
            for key, v in entries.items()
        }
    return {"state": out, "param_groups": state["param_groups"]}


def meta_twin(net: nn.Module) -> nn.Module:
    """A plain deep copy of ``net`` (before sharding) whose parameters live on the ``meta`` device
    (no memory), with the same names and ``requires_grad``; buffers are copied as they are."""
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad) for p in net.parameters()
    }
    return copy.deepcopy(net, memo)


def gathered_twin(net: nn.Module, twin: nn.Module) -> nn.Module | None:
    """``twin`` holding every weight of the sharded ``net`` (CPU) on rank 0; ``None`` on other ranks.
    Collective: call it on every rank."""
    state = full_dict(net.state_dict())
    if _rank() != 0:
        return None
    twin.load_state_dict(state, strict=False, assign=True)
    return twin
