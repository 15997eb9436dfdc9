"""Data parallelism through accelerate: one process per rank (gloo on CPU, NCCL on GPUs), the trained
network and the optimizer prepared by ``Accelerator.prepare`` (DDP), gradients accumulated under
``no_sync`` and all-reduced once per optimizer step.

Launch: ``ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 -m flowcredit train …`` on
CPU, ``accelerate launch --config_file configs/ddp.yaml -m flowcredit train …`` on GPUs
(docs/gpu.md). Each rank rolls out its share of the prompt groups; rank 0 alone writes the run
directory. With one process (and no FSDP config) there is no accelerator and everything here is the
identity: the single-process path is plain PyTorch.

Only the update's policy passes run through the wrapper (:meth:`Dist.wrapped_net`): rollouts,
value completions and evaluation call the plain network, which holds the same parameters.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from flowcredit.errors import UserError


def fsdp_requested() -> bool:
    """True under ``accelerate launch`` with an FSDP config (it sets ``ACCELERATE_USE_FSDP``)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true")


class Dist:
    """Rank, world size, the prepared network and the few collectives the trainer needs."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0
        self.accelerator = None
        self.net: torch.nn.Module | None = None  # the prepared (DDP / FSDP) network; None: no wrapper
        if self.world > 1 or fsdp_requested():
            from accelerate import Accelerator, DistributedDataParallelKwargs

            # buffers are constants here; broadcasting them would add a collective to every forward
            # pass, and ranks run different numbers of forward passes (their kept rows differ)
            ddp = DistributedDataParallelKwargs(broadcast_buffers=False)
            self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[ddp])
            self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def prepare(self, net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Hand ``net`` (the adapter's trained network) and its optimizer to ``Accelerator.prepare``;
        returns the optimizer to step. Identity without an accelerator. An FSDP launch config is
        refused: the checkpoint, the EMA and the final export read plain tensors on rank 0, and
        gathering sharded ones is not written yet (the adapter's ``fsdp_block_classes`` are ready
        for it: accelerate's FSDP2 wrap policy picks them, tests/test_adapters_diffusers.py)."""
        if self.accelerator is None:
            return optimizer
        if fsdp_requested():
            raise UserError(
                "FSDP launch config: the trainer cannot yet gather FSDP-sharded weights for its "
                "checkpoints and final export (docs/gpu.md, 'Several GPUs'); use configs/ddp.yaml"
            )
        with warnings.catch_warnings():  # torch renames broadcast_buffers; accelerate passes the old name
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            self.net, optimizer = self.accelerator.prepare(net, optimizer)
        return optimizer

    @contextlib.contextmanager
    def wrapped_net(self, model):
        """Within the context ``model.net`` is the prepared wrapper, so the adapter's own ``velocity``
        runs the DDP forward (whose hooks reduce the gradients in the backward)."""
        if self.net is None:
            yield
            return
        plain, model.net = model.net, self.net
        try:
            yield
        finally:
            model.net = plain

    def accumulating(self, sync: bool):
        """Context of one micro-batch's forward and backward: gradients stay local (``no_sync``) unless
        ``sync`` (the optimizer step's last micro-batch on this rank)."""
        if self.net is None or sync:
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.net)

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is None:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def clip_grad_norm_(self, params: list[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the (already reduced) gradients; returns the norm before clipping."""
        if self.accelerator is None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm).item()
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns the tensor). Runs on the backend's device (NCCL: the GPU)."""
        if self.world > 1:
            tensor.copy_(self.accelerator.reduce(tensor.to(self.accelerator.device), "sum"))
        return tensor

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(n, …)`` on every rank → ``(world·n, …)`` (equal ``n`` on all ranks), on ``tensor``'s device."""
        if self.world == 1:
            return tensor
        return self.accelerator.gather(tensor.contiguous().to(self.accelerator.device)).to(tensor.device)
