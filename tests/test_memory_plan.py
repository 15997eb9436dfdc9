"""``flowcredit memory`` (issue 57): the fake-tensor estimate against a real run, its JSON, its errors.

The check of the method: on a tiny random SD3 pipeline (``tiny_diffusers``), the same phases run once on
real CPU tensors and once on a fake copy of the same modules (shapes and dtypes only), both counted by
:class:`LiveStorages`; the fake run's update peak and saved activations must equal the real run's
within 2 %. The real-size estimate itself (the 2026-11-29 H200 check) is a command, documented in
docs/gpu.md ("Will it fit?"), not a test: it takes about 20 s.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
from tiny_diffusers import build_sd3

from flowcredit import cli
from flowcredit.commands import memory_budget, memory_models, memory_plan
from flowcredit.commands.memory_plan import PARTS, PHASES, LiveStorages, make_policy, run_phases
from flowcredit.errors import ConfigError
from flowcredit.presets import load_config

FIELDS = [
    "--model",
    "sd3",
    "--dtype",
    "float32",
    "--batch_size",
    "4",
    "--lora_rank",
    "4",
    "--prompts_per_iter",
    "2",
]


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory):
    from flowcredit.models.sd3 import SD3FlowModel

    directory = build_sd3(tmp_path_factory.mktemp("sd3") / "pipe")
    return SD3FlowModel.from_pretrained(str(directory), dtype="float32", device="cpu")


def fake_copy(model):
    """A copy of the adapter whose every module holds fake tensors of the same shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    twin = copy.deepcopy(model)
    for module in [m for m in twin.pipe.components.values() if isinstance(m, torch.nn.Module)]:
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if p is not None:
                    sub._parameters[name] = torch.nn.Parameter(mode.from_tensor(p), p.requires_grad)
            for name, b in list(sub._buffers.items()):
                if b is not None:
                    sub._buffers[name] = mode.from_tensor(b)
    twin.net = twin.pipe.transformer
    twin.vae = twin.pipe.vae
    return twin, mode


def phases(model, cfg, mode=None):
    if mode is None:
        return run_phases(cfg, model, make_policy(cfg, model))
    saved_to = torch.nn.Module.to
    torch.nn.Module.to = lambda self, *a, **k: self  # fake parameters cannot be swapped (memory_plan)
    try:
        with mode:
            policy = make_policy(cfg, model)
    finally:
        torch.nn.Module.to = saved_to
    return run_phases(cfg, model, policy)


def test_fake_estimate_equals_the_real_runs_counted_peak(tiny_sd3):
    cfg = load_config("flow_grpo", None, FIELDS)
    real = phases(copy.deepcopy(tiny_sd3), cfg)
    fake_model, mode = fake_copy(tiny_sd3)
    fake = phases(fake_model, cfg, mode)
    assert set(real["phases"]) == set(fake["phases"]) == set(PHASES)
    for phase in PHASES:
        r, f = real["phases"][phase], fake["phases"][phase]
        assert f["weights"] == r["weights"] and f["optimizer"] == r["optimizer"], phase
        assert f["peak"] == pytest.approx(r["peak"], rel=0.02), phase
    upd_r, upd_f = real["phases"]["update"], fake["phases"]["update"]
    assert upd_r["activations"] > 0.3 * (upd_r["peak"] - upd_r["weights"])  # the update's peak is activations
    assert upd_f["activations"] == pytest.approx(upd_r["activations"], rel=0.02)
    assert real["attention_kernel"] == fake["attention_kernel"]


def test_gradient_checkpointing_lowers_the_update_activations(tiny_sd3):
    base = load_config("flow_grpo", None, FIELDS)
    ckpt = load_config("flow_grpo", None, [*FIELDS, "--gradient_checkpointing", "true"])
    plain = phases(copy.deepcopy(tiny_sd3), base)["phases"]["update"]
    saved = phases(copy.deepcopy(tiny_sd3), ckpt)["phases"]["update"]
    assert saved["activations"] < 0.6 * plain["activations"]


def test_live_storages_counts_what_stays_referenced():
    with LiveStorages() as counter:
        a = torch.zeros(1000)  # 4000 bytes
        b = a[:10]  # a view: no new storage
        c = torch.ones(500)
        del c
    assert counter.current == 4000 and counter.peak == 6000
    del a, b


@pytest.fixture
def small_sizes(monkeypatch):
    """A 2-layer SD3 transformer as ``--size test``, a narrow VAE and 1-layer text encoders."""
    small = memory_models.SD35_MEDIUM | dict(num_layers=2, num_attention_heads=2, attention_head_dim=16)
    small |= dict(caption_projection_dim=32, dual_attention_layers=(0,), pos_embed_max_size=16)
    monkeypatch.setitem(memory_models.SIZES["sd3"], "test", small)
    monkeypatch.setattr(
        memory_models, "SD3_VAE", memory_models.SD3_VAE | dict(block_out_channels=(32, 32, 32, 32))
    )
    monkeypatch.setattr(
        memory_models, "TINY_TEXT", dict(num_hidden_layers=1, intermediate_size=8, num_attention_heads=1)
    )


def test_json_has_every_phase_and_part(small_sizes, capsys):
    argv = [
        "memory",
        "--size",
        "test",
        "--tiny_text_encoders",
        "--resolution",
        "64",
        "--batch_size",
        "2",
        "--json",
    ]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["phases"]) == set(PHASES)
    for phase in PHASES:
        assert set(out["phases"][phase]) == {*PARTS, "peak"}
        assert out["phases"][phase]["peak"] == sum(out["phases"][phase][k] for k in PARTS)
    assert out["peak"] == max(p["peak"] for p in out["phases"].values())
    assert out["settings"]["transformer_rows"] == 4 and out["attention_kernel"]


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--batch_sizee", "8"], "batch_sizee"),
        (["--size", "huge"], "'size'"),
        (["--model", "wan"], "'model'"),
        (["--dtype", "float8"], "'dtype'"),
    ],
)
def test_a_bad_field_names_itself(argv, culprit, capsys):
    assert cli.main(["memory", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0], err


SMALL = [
    "--model",
    "sd3",
    "--dtype",
    "bfloat16",
    "--resolution",
    "64",
    "--batch_size",
    "2",
    "--prompts_per_iter",
    "2",
    "--group_size",
    "4",
]


def small_estimate(*fields, reward="jpeg_compressibility"):
    cfg = load_config("flow_grpo", None, [*SMALL, "--reward", reward, *fields])
    return memory_plan.estimate(cfg, "test", tiny_text=True)["phases"]


def test_text_placement_takes_the_encoders_out_of_the_phases_it_says(small_sizes):
    from flowcredit.models.memory_options import text_encoder_modules

    device = small_estimate()
    built = memory_plan.build(load_config("flow_grpo", None, SMALL), "test", tiny_text=True)
    text = memory_plan.storage_bytes(*text_encoder_modules(built.model.pipe))
    assert text > 0
    offload, cpu = small_estimate("--text_encoders", "offload"), small_estimate("--text_encoders", "cpu")
    for phase in PHASES:
        away = phase != "text_encoding"
        assert offload[phase]["weights"] == device[phase]["weights"] - text * away, phase
        assert cpu[phase]["weights"] == device[phase]["weights"] - text, phase
    assert cpu["text_encoding"]["temporaries"] < device["text_encoding"]["temporaries"]


def test_decode_chunk_and_batch_lower_their_phases(small_sizes):
    base, chunk1 = small_estimate(), small_estimate("--decode_chunk", "1")
    for phase in ("values", "reward"):  # decodes only (evaluation's peak may be its transformer pass)
        assert chunk1[phase]["temporaries"] < base[phase]["temporaries"], phase
    assert small_estimate("--batch_size", "1")["update"]["activations"] < base["update"]["activations"]


def test_float8_base_halves_the_block_weights(small_sizes):
    pytest.importorskip("torchao", reason="needs the 'quant' extra")
    from flowcredit.models.memory_options import QUANTIZED_BLOCKS

    built = memory_plan.build(load_config("flow_grpo", None, SMALL), "test", tiny_text=True)
    cfg8 = load_config("flow_grpo", None, [*SMALL, "--base_quantization", "float8"])
    built8 = memory_plan.build(cfg8, "test", tiny_text=True)

    def blocks(net):  # the base layers (LoRA's own Linear layers stay float32)
        named = [
            (n, m) for n, m in net.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n
        ]
        return [m for n, m in named if n.startswith(QUANTIZED_BLOCKS)]

    bf16 = sum(m.weight.numel() for m in blocks(built.model.net))
    rows = sum(m.weight.shape[0] for m in blocks(built.model.net))  # one float32 scale per output row
    assert memory_plan.storage_bytes(*[m.weight for m in blocks(built8.model.net)]) == bf16 + 4 * rows
    assert memory_plan.storage_bytes(*[m.weight for m in blocks(built.model.net)]) == 2 * bf16


def test_reward_clips_have_their_hub_sizes():
    with torch.device("meta"):
        h14 = memory_models.clip_model(memory_models.CLIP_H14, torch.float32)
        l14 = memory_models.clip_model(memory_models.CLIP_L14, torch.float32)
    assert 986.0e6 < sum(p.numel() for p in h14.parameters()) < 986.2e6  # laion CLIP ViT-H/14
    assert 427.5e6 < sum(p.numel() for p in l14.parameters()) < 427.7e6  # openai clip-vit-large-patch14


def test_reward_network_counted_where_its_options_put_it(small_sizes, monkeypatch):
    tiny_clip = dict(
        text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
        projection_dim=16,
        act="gelu",
    )
    monkeypatch.setitem(memory_models.REWARD_CLIPS, "pickscore", tiny_clip)
    with_net = small_estimate(reward="pickscore")
    clip = memory_plan.storage_bytes(memory_models.clip_model(tiny_clip, torch.float32))
    base = small_estimate()
    for phase in PHASES:
        assert with_net[phase]["weights"] == base[phase]["weights"] + clip, phase
    offload = small_estimate("--reward_options", '{"pickscore": {"offload": true}}', reward="pickscore")
    cpu = small_estimate("--reward_options", '{"pickscore": {"device": "cpu"}}', reward="pickscore")
    for phase in PHASES:
        assert offload[phase]["weights"] == base[phase]["weights"] + clip * (phase == "reward"), phase
        assert cpu[phase]["weights"] == base[phase]["weights"], phase


def test_budget_plan_fits_or_names_the_phase(small_sizes, monkeypatch):
    monkeypatch.setattr(memory_budget, "HEADROOM", 0)
    cfg = load_config("flow_grpo", None, SMALL)
    as_given = memory_plan.estimate(cfg, "test", tiny_text=True)
    budget = as_given["peak"] - 1
    plan = memory_budget.fit(cfg, budget, "test", tiny_text=True)
    assert plan["changes"] and plan["estimate"]["peak"] <= budget
    assert plan["tried"][0]["peak"] == as_given["peak"] and plan["tried"][-1]["peak"] <= budget
    again = memory_plan.estimate(replace(cfg, **plan["changes"]), "test", tiny_text=True)
    assert again["peak"] == plan["estimate"]["peak"]  # the plan's flags reproduce its estimate
    with pytest.raises(ConfigError, match="memory_budget.*phase needs.*allow_quantization"):
        memory_budget.fit(cfg, 1000, "test", tiny_text=True)


@pytest.mark.parametrize("text, gib", [("24GiB", 24), ("24 GB", 24), ("80", 80), ("1.5g", 1.5)])
def test_budget_sizes(text, gib):
    assert memory_budget.parse_bytes(text) == int(gib * 2**30)


def test_a_bad_budget_names_itself():
    with pytest.raises(ConfigError, match="memory_budget"):
        memory_budget.parse_bytes("lots")


def test_docs_table_is_the_published_plans():
    """docs/gpu.md's "What fits where" table is what benchmarks/memory/memory_plans.py prints from its
    JSON (so neither changes alone)."""
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("memory_plans", repo / "benchmarks/memory/memory_plans.py")
    plans = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plans)
    table = plans.table(json.loads(plans.RESULTS.read_text())["rows"])
    assert table in (repo / "docs" / "gpu.md").read_text()
    for row in json.loads(plans.RESULTS.read_text())["rows"]["SD3.5-M flow_grpo"].values():
        assert row["fits"] and row["estimate"]["peak"] <= row["budget"] - row["headroom"]
