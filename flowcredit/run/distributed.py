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

FSDP (``accelerate launch --config_file configs/fsdp.yaml``): accelerate shards the network in place
with FSDP2 (``fully_shard`` on each of the adapter's ``fsdp_block_classes``, then the root), so every
forward pass is a collective: under :attr:`Dist.sharded` every rank runs the same passes (evaluation
included), and the checkpoint, the EMA and the export gather full tensors with
:mod:`flowcredit.run.sharding`. accelerate cannot shard on CPUs (it drops its FSDP plugin with
``cpu=True``); the tests shard with torch's own ``fully_shard`` instead, through the test-only
environment variable ``FLOWCREDIT_TEST_FULLY_SHARD=1`` (:func:`_fully_shard`, gloo on 2 CPU
processes).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from flowcredit.errors import UserError
from flowcredit.run.sharding import meta_twin

TEST_SHARD_ENV = "FLOWCREDIT_TEST_FULLY_SHARD"  # tests only: shard with torch's fully_shard (no accelerate)


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
        self.twin: torch.nn.Module | None = None  # FSDP: a plain copy on the meta device, for the export
        self.test_shard = os.environ.get(TEST_SHARD_ENV) == "1"
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

    @property
    def sharded(self) -> bool:
        """FSDP: the network's weights are ``DTensor`` shards, and every forward pass is a collective."""
        return self.accelerator is not None and (fsdp_requested() or self.test_shard)

    def prepare(
        self, net: torch.nn.Module, optimizer: torch.optim.Optimizer, blocks: tuple[str, ...] = ()
    ) -> torch.optim.Optimizer:
        """Hand ``net`` (the adapter's trained network) and its optimizer to ``Accelerator.prepare``;
        returns the optimizer to step. Identity without an accelerator. Under FSDP, ``blocks`` (the
        adapter's ``fsdp_block_classes``) are the units to shard unless the launch config names
        its own (``fsdp_transformer_layer_cls_to_wrap``); the optimizer must hold no state yet (a
        checkpoint is restored after sharding, into the shards)."""
        if self.accelerator is None:
            return optimizer
        if self.sharded:
            from accelerate.utils import DistributedType

            if not self.test_shard and self.accelerator.distributed_type != DistributedType.FSDP:
                raise UserError(
                    "FSDP launch config without GPUs: accelerate does not shard on CPUs (it drops its "
                    "FSDP plugin with cpu=True); use configs/ddp.yaml, or torchrun on CPUs (docs/gpu.md)"
                )
            self.twin = meta_twin(net)
            if self.test_shard:
                self.net = _fully_shard(net, optimizer, blocks)
            else:
                plugin = self.accelerator.state.fsdp_plugin
                if plugin.transformer_cls_names_to_wrap is None and blocks:
                    plugin.transformer_cls_names_to_wrap = list(blocks)
                self.net, optimizer = self.accelerator.prepare(net, optimizer)
            # FSDP2 keeps the root (and accelerate's tail unit) unsharded after a forward pass by
            # default, and the module then holds plain copies of those weights until the next
            # backward: the EMA swap, the checkpoint and a restore would read or write stale copies
            # after a no-grad pass (rollout, evaluation). Resharding after every pass avoids that.
            self.net.set_reshard_after_forward(True)
            return optimizer
        with warnings.catch_warnings():  # torch renames broadcast_buffers; accelerate passes the old name
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            self.net, optimizer = self.accelerator.prepare(net, optimizer)
        return optimizer

    @contextlib.contextmanager
    def unsharded(self, model):
        """Within the context, on rank 0, ``model.net`` is a plain network holding every gathered weight
        (CPU), for the export (the adapter's ``save_final``, ``Policy.trainable_state``); other ranks
        only take part in the gathering. Without FSDP: nothing changes. Every rank enters it."""
        if not self.sharded:
            yield
            return
        from flowcredit.run.sharding import gathered_twin

        plain, twin = model.net, gathered_twin(model.net, self.twin)
        model.net = twin if twin is not None else plain
        try:
            yield
        finally:
            model.net = plain

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
        if self.sharded:  # what accelerate's no_sync does for FSDP2, also for the test's fully_shard
            return _no_gradient_sync(self.net)
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
        norm = self.accelerator.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP: a DTensor

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


@contextlib.contextmanager
def _no_gradient_sync(net):
    net.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        net.set_requires_gradient_sync(True)


def _fully_shard(net: torch.nn.Module, optimizer: torch.optim.Optimizer, blocks: tuple[str, ...]):
    """Test only (``FLOWCREDIT_TEST_FULLY_SHARD=1``): FSDP2 as accelerate applies it, with torch's
    ``fully_shard`` on a 1-D CPU mesh: each module of a class in ``blocks``, then the root. The new
    ``DTensor`` parameters replace the plain ones in ``optimizer`` (by name, as accelerate does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = {p: n for n, p in net.named_parameters()}
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for module in reversed(list(net.modules())[1:]):  # inner blocks before outer ones, as accelerate
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)
    sharded = dict(net.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[p]] for p in group["params"]]
    return net
