"""Scale-out outside the loop's maths: shipped launch configs, trackers, memory options, FSDP wrapping."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from flowcredit.config import Config
from flowcredit.errors import ConfigError
from flowcredit.models import FlowModelBase, load_builtin
from flowcredit.run.policy import Policy
from flowcredit.run.runlog import read_metrics
from flowcredit.run.session import configure_network
from flowcredit.validation import validate

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _named_configs() -> dict[str, list[str]]:
    """``configs/*.yaml`` path → the documents that name it."""
    named: dict[str, list[str]] = {}
    for doc in DOCS:
        for path in re.findall(r"configs/[\w.-]+\.yaml", doc.read_text()):
            named.setdefault(path, []).append(doc.name)
    return named


def test_every_launch_config_the_docs_name_exists_and_accelerate_reads_it():
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.utils import DistributedType

    named = _named_configs()
    assert {"configs/ddp.yaml", "configs/fsdp.yaml", "configs/multinode.yaml"} <= set(named)
    for path, docs in named.items():
        assert (REPO / path).is_file(), f"{docs} name {path}, which does not exist"
        ClusterConfig.from_yaml_file(str(REPO / path))  # raises on unknown keys or values
    fsdp = ClusterConfig.from_yaml_file(str(REPO / "configs" / "fsdp.yaml"))
    assert fsdp.distributed_type == DistributedType.FSDP and fsdp.fsdp_config["fsdp_version"] == 2
    multi = ClusterConfig.from_yaml_file(str(REPO / "configs" / "multinode.yaml"))
    assert multi.num_machines == 2 and multi.main_process_ip and multi.machine_rank == 0


def test_docs_show_no_inline_launch_config():
    for doc in DOCS:
        assert "distributed_type:" not in doc.read_text(), f"{doc.name} shows a launch config inline"


def test_scale_out_fields_are_validated():
    with pytest.raises(ConfigError, match="log_with"):
        validate(Config(log_with="mlflow"))
    validate(Config(log_with="none", gradient_checkpointing=True, compile=True))


def test_wandb_missing_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name))
    with pytest.raises(ConfigError, match=r"flowcredit\[wandb\]"):
        validate(Config(log_with="wandb"))


class PlainNet(FlowModelBase):
    """An adapter whose network has no gradient checkpointing."""

    latent_shape, guidance_scale = (1,), 1.0

    def __init__(self):
        self.net = torch.nn.Linear(1, 1)

    def encode(self, prompts):
        return None

    def velocity(self, x, sigma, cond):
        return self.net(x)

    def decode(self, x):
        return x


def test_gradient_checkpointing_on_a_network_without_it_names_the_field():
    with pytest.raises(ConfigError, match="gradient_checkpointing.*PlainNet.*Linear"):
        configure_network(Config(gradient_checkpointing=True), PlainNet())
    assert PlainNet().fsdp_block_classes == ()


def test_tiny_gradient_checkpointing_recomputes_the_same_gradients():
    """Checkpointing trades memory for compute only: the LoRA gradients are bit-identical."""
    grads = []
    for on in (False, True):
        model = load_builtin()
        policy = Policy(model, "all")
        configure_network(Config(gradient_checkpointing=on), model)
        x = torch.randn((2, *model.latent_shape), generator=torch.Generator().manual_seed(0))
        cond = model.encode(["a red circle", "two squares"])
        model.velocity(x, torch.tensor([0.3, 0.8]), cond).square().sum().backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
    assert model.net.unet.gradient_checkpointing and model.fsdp_block_classes == ("ResBlock",)
    assert all(torch.equal(a, b) for a, b in zip(*grads)) and any(g.abs().sum() > 0 for g in grads[0])


def test_wandb_offline_run_logs_scalars_grids_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="needs the 'wandb' extra: pip install -e '.[test]'")
    from flowcredit.train import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        log_with="wandb",
        iterations=1,
        prompts_per_iter=1,
        group_size=2,
        num_steps=3,
        num_train_prompts=2,
        num_eval_prompts=1,
        eval_samples_per_prompt=1,
        eval_every=1,
        lr=3e-4,
    )
    train(validate(cfg))
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    history, config = {}, {}
    for record in wandb_records(next(offline.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            step = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(step["_step"], {}).update(step)
        updates = {"config": record.config.update, "run": record.run.config.update}.get(kind, [])
        config.update({i.key: json.loads(i.value_json) for i in updates})
    assert config["log_with"] == "wandb" and config["group_size"] == 2
    assert sorted(history) == [0, 1]  # the start evaluation, then iteration 1
    assert history[1]["reward/mean"] == pytest.approx(read_metrics(tmp_path / "run")[1]["reward/mean"])
    for step in (0, 1):  # an image grid per evaluated set at each evaluation
        assert history[step]["eval/test/_type"] == "images/separated" and "eval/test/soft" in history[step]
    assert len(list((offline / "files" / "media" / "images").rglob("*.png"))) == 4  # 2 sets × 2 evaluations


def wandb_records(path: Path) -> list:
    """The records of an offline run's ``.wandb`` file: a 7-byte file header, then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle,
    4 last) holding a serialised ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, part, out = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if left < 7 or (length == 0 and kind == 0):  # the rest of the block is padding
            pos += left
            continue
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            out.append(record)
            part = b""
    return out


def test_an_fsdp_launch_on_cpus_is_refused_with_a_clear_error(monkeypatch):
    """accelerate drops its FSDP plugin with ``cpu=True``: the trainer says so instead of running DDP."""
    from flowcredit.errors import UserError
    from flowcredit.run.distributed import Dist

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch` with configs/fsdp.yaml sets
    net = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="FSDP.*CPUs.*configs/ddp.yaml"):
        Dist().prepare(net, torch.optim.AdamW(net.parameters()))


@pytest.mark.parametrize("named", [None, ["TextBlock"]])
def test_an_fsdp_launch_hands_the_adapter_blocks_to_accelerate(monkeypatch, named):
    """On GPUs ``Dist.prepare`` gives accelerate's FSDP2 plugin the adapter's ``fsdp_block_classes``
    unless the launch config names its own, and keeps a plain twin of the network on the meta device
    for the export (accelerate's own sharding needs GPUs: a stand-in accelerator records the call)."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from flowcredit.run.distributed import Dist

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, transformer_cls_names_to_wrap=named)
    seen = {}

    class Accelerator:
        distributed_type = DistributedType.FSDP
        state = type("State", (), {"fsdp_plugin": plugin})()

        def prepare(self, net, optimizer):
            seen["blocks"] = plugin.transformer_cls_names_to_wrap
            net.set_reshard_after_forward = lambda *flag: seen.update(reshard=flag)  # an FSDPModule's
            return net, optimizer

    model = load_builtin()
    dist = Dist()
    dist.accelerator = Accelerator()
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert dist.sharded
    dist.prepare(model.net, torch.optim.AdamW(model.net.parameters()), model.fsdp_block_classes)
    assert seen["blocks"] == (named or ["ResBlock"]) and seen["reshard"] == (True,)
    twin = dict(dist.twin.named_parameters())
    assert list(twin) == [n for n, _ in model.net.named_parameters()]
    assert {p.device.type for p in twin.values()} == {"meta"}
