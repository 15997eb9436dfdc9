"""Data-parallel helpers: one process per rank through accelerate (gloo on CPU, NCCL on GPUs).

Launch: ``ACCELERATE_USE_CPU=1 torchrun --standalone --nproc_per_node 2 -m flowcredit train …`` on
CPU, ``accelerate launch --multi_gpu --num_processes K -m flowcredit train …`` on GPUs. Each rank rolls
out its share of the prompt groups (whole groups, so advantages need no communication), gradients
are summed across ranks before clipping, and rank 0 alone writes the run directory. With one process
everything here is a no-op.
"""

from __future__ import annotations

import os

import torch


class Dist:
    """Rank, world size and the few collectives the trainer needs."""

    def __init__(self):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = 0
        self.accelerator = None
        if self.world > 1:
            from accelerate import Accelerator

            self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
            self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (returns the tensor). Runs on the backend's device (NCCL: the GPU)."""
        if self.world > 1:
            on_device = tensor.to(self.accelerator.device)
            torch.distributed.all_reduce(on_device, op=torch.distributed.ReduceOp.SUM)
            tensor.copy_(on_device)
        return tensor

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(n, …)`` on every rank → ``(world·n, …)`` (equal ``n`` on all ranks), on ``tensor``'s device."""
        if self.world == 1:
            return tensor
        local = tensor.contiguous().to(self.accelerator.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        torch.distributed.all_gather(parts, local)
        return torch.cat(parts).to(tensor.device)

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks (each rank's loss is already weighted by the global row count)."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.sum_(p.grad)
