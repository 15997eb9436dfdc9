"""The newer methods on every adapter (issues 39, 60): each preset of ``NEWER_PRESETS`` (mixgrpo,
tempflow_grpo, egrpo, grpo_guard, diffusion_nft, awm, flow_dppo, coca) on the built-in model and on the tiny
random-config SD3, FLUX.1, Qwen-Image, Wan2.1 and Z-Image pipelines (tests/tiny_diffusers.py), each with
its preset's own step schedule, SDE window, step weights and update rule, options included (no
``_options`` overrides: TempFlow-GRPO branches at every step but the last, E-GRPO merges its steps,
MixGRPO's window of 2 sits at its first position, AWM explores steps 0–6 of 10, Flow-DPPO 0–4 of 6).

Checks, per adapter × preset:
- float32 (and AWM in bfloat16, see ``RESUMED``): the first iteration trains (every metric finite, a
  nonzero advantage, the LoRA moved, every base weight bit-identical, DiffusionNFT's and AWM's old
  policy checkpointed and moved), and a run stopped right after iteration 1's checkpoint and resumed to
  2 iterations equals the uninterrupted run: every checkpoint file (LoRA, optimizer, ``old.safetensors``,
  ``state.json``) and the exported weights byte for byte, and the whole metrics.jsonl.
- bfloat16, the other presets: the first iteration trains, with the same checks.
The built-in model has no bf16 weights: its bf16 runs are ``autocast=True`` (bf16 compute on fp32
weights, its one bf16 mode).

Sizes: 4 steps (AWM: the 10 its window assumes), 1 prompt × 2 samples (TempFlow-GRPO: × 3 branches),
β = 0.01 (the reference pass runs), the brightness reward (continuous: a group of 2 never ties, so an
advantage is never all zero), one evaluation prompt sampled in 2 steps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from loop_probes import small_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_diffusers import BUILDERS, train_config  # noqa: E402

import flowcredit.train  # noqa: E402
from flowcredit.config import Config  # noqa: E402
from flowcredit.models import load_model  # noqa: E402
from flowcredit.presets import NEWER_PRESETS, PRESETS  # noqa: E402
from flowcredit.run.policy import Policy  # noqa: E402
from flowcredit.run.session import Session  # noqa: E402
from flowcredit.train import train  # noqa: E402
from flowcredit.validation import validate  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
KINDS = ("tiny", *BUILDERS)
PROMPTS = ["a red square", "a photo of a cat"]
FORWARD = ("nft", "awm", "dgpo")  # forward-process update rules (DiffusionNFT, AWM, DGPO): an old policy too
SMALL = dict(reward="reward_fixtures:brightness", prompts_per_iter=1, num_eval_prompts=1, eval_num_steps=2)
SMALL |= dict(threads=1, log_with="none")
NUM_STEPS = {"awm": 10, "flow_dppo": 6}  # AWM's window 7 assumes 10 steps (σ' ∈ [0.3, 0.9]); Flow-DPPO's is 5
TREES = {"tree_grpo": dict(group_size=4, step_schedule_options='{"fanout": 2, "depth": 2}')}  # 4 leaves
TREES["branch_grpo"] = dict(group_size=4, step_schedule_options='{"splits": [0, 1]}')  # 4 leaves, SDE on 0–2
RESUMED = [(preset, "float32") for preset in NEWER_PRESETS] + [("awm", "bfloat16")]
"""The resume tests: every preset in float32, and AWM (the most state: LoRA, optimizer, old policy; an
SDE window and a KL to the old policy) in bfloat16 too; the other presets' bf16 runs train one iteration."""


@pytest.fixture(autouse=True)
def no_curve_plot(monkeypatch):
    """No ``reward_curve.png``: matplotlib's plot (about 0.15 s a run) is not what these tests check."""
    monkeypatch.setattr(flowcredit.train, "plot_curves", lambda run_dir: None)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Every tiny pipeline, saved once, and the prompt file of the diffusers runs."""
    root = tmp_path_factory.mktemp("pipes_methods")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    pipes = {kind: build(root / kind) for kind, build in BUILDERS.items()}
    return {"prompts": root / "prompts.txt", "tiny16": small_model(root / "tiny16")} | pipes


def method_config(preset: str, kind: str, dirs, run_dir, dtype: str, iterations: int = 1) -> Config:
    """``preset`` at test size on ``kind``, with the preset's own SDE window (AWM's, steps 0–6, at the
    10 steps it assumes; the others' 0: every step but the last); the built-in model (a small random
    one, ``loop_probes.small_model``: bf16 autocast with the built-in weights took 13–52 s a test on a
    CPU without bf16 instructions) trains on two ShapeEval prompts (its tokenizer knows ShapeEval's
    words only) with ``dtype`` "bfloat16" meaning ``autocast``."""
    if kind == "tiny":
        cfg = dataclasses.replace(
            PRESETS[preset](),
            checkpoint=str(dirs["tiny16"]),
            num_train_prompts=2,
            eval_samples_per_prompt=1,
            eval_every=0,
            num_steps=4,
            group_size=2,
            batch_size=4,
            window_size=0,
            beta=0.01,
            autocast=dtype == "bfloat16",
        )
    else:
        cfg = train_config(preset, kind, dirs[kind], dirs["prompts"], run_dir)
        cfg.dtype = dtype
    window = dict(num_steps=NUM_STEPS.get(preset, 4), window_size=PRESETS[preset]().window_size)
    window |= TREES.get(preset, {})
    return validate(dataclasses.replace(cfg, **SMALL, **window, run_dir=str(run_dir), iterations=iterations))


_INITIAL: dict[tuple, dict[str, torch.Tensor]] = {}


def initial_lora(cfg: Config) -> dict[str, torch.Tensor]:
    """The LoRA weights a run of ``cfg`` starts from (the same for every preset of one model and dtype:
    drawn from ``cfg.seed``; computed once per model, dtype and LoRA setting)."""
    key = (cfg.model, cfg.checkpoint, cfg.dtype, cfg.autocast, cfg.seed)
    key += (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    if key not in _INITIAL:
        policy = Policy(
            load_model(cfg), "lora", cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, seed=cfg.seed
        )
        _INITIAL[key] = policy.trainable_state()
    return _INITIAL[key]


def train_checked(cfg: Config):
    """Train ``cfg`` on a model loaded here; then every base weight of its network is bit for bit what
    was loaded, and every number of every metrics row is finite. Returns the model."""
    model = load_model(cfg)
    base = {k: v.clone() for k, v in model.net.state_dict().items()}
    train(cfg, model=model)
    after = {k.replace(".base_layer.", "."): v for k, v in model.net.state_dict().items() if "lora_" not in k}
    assert after.keys() == base.keys()
    assert all(torch.equal(after[k], base[k]) for k in base), "a base weight changed"
    for row in map(json.loads, (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()):
        numbers = {k: v for k, v in row.items() if isinstance(v, float) and not k.endswith("/strict")}
        assert all(math.isfinite(v) for v in numbers.values()), row  # "strict": NaN off ShapeEval
    return model


def assert_dtype(model, dtype: str) -> None:
    """The run computed in ``dtype``: a diffusers model's weights, or the built-in model's autocast."""
    if hasattr(model, "autocast"):
        assert model.autocast == (dtype == "bfloat16")
    else:
        assert model.dtype == getattr(torch, dtype)


def check_first_iteration(run: Path, cfg: Config) -> None:
    """Iteration 1 of the run in ``run`` trained: its metrics row has a policy loss and a nonzero
    advantage, its checkpointed LoRA moved from the initial draw, and a forward-process preset
    checkpointed its old policy (the LoRA's shapes, moved too)."""
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[1])
    assert row["iteration"] == 1 and "loss/policy" in row and row["adv/abs_mean"] > 0, row
    init, trained = initial_lora(cfg), load_file(str(run / "checkpoint" / "trainable.safetensors"))
    assert trained.keys() == init.keys() and all("lora_" in k for k in init)
    assert any(not torch.equal(trained[k], init[k]) for k in init), "no LoRA weight moved"
    has_old = (run / "checkpoint" / "old.safetensors").is_file()
    assert has_old == (cfg.update in FORWARD)
    if has_old:  # its names are indices: the trainable parameters' order
        old = list(load_file(str(run / "checkpoint" / "old.safetensors")).values())
        assert [o.shape for o in old] == [v.shape for v in init.values()]
        assert any(not torch.equal(o, v) for o, v in zip(old, init.values())), "the old policy stayed"


@pytest.mark.parametrize(("preset", "dtype"), RESUMED)
@pytest.mark.parametrize("kind", KINDS)
def test_method_trains_and_resumes_exactly(dirs, kind, preset, dtype, tmp_path, monkeypatch):
    """The uninterrupted 2-iteration run trains (``train_checked``; ``check_first_iteration`` on
    its state after iteration 1). A copy of its run directory taken right after iteration 1's checkpoint
    (a run stopped there, killed with nothing written after its checkpoint; one training iteration
    fewer than a separate 1-iteration run) resumed to 2 iterations equals it: every checkpoint file (the
    LoRA, the optimizer, the old policy of DiffusionNFT / AWM, state.json) and the exported weights
    byte for byte, and the whole metrics.jsonl (iteration 2's evaluation included)."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    real_save = Session.save

    def save_and_copy(s: Session, iteration: int) -> None:
        real_save(s, iteration)
        if iteration == 1:
            shutil.copytree(s.run_dir, stopped)

    monkeypatch.setattr(Session, "save", save_and_copy)
    cfg = method_config(preset, kind, dirs, full, dtype, iterations=2)
    assert_dtype(train_checked(cfg), dtype)
    monkeypatch.setattr(Session, "save", real_save)
    check_first_iteration(stopped, cfg)
    train(dataclasses.replace(cfg, run_dir=str(stopped)), resume=True)
    names = sorted(p.name for p in (full / "checkpoint").iterdir())
    assert names == sorted(p.name for p in (stopped / "checkpoint").iterdir())
    assert ("old.safetensors" in names) == (cfg.update in FORWARD)
    for name in names:
        assert (stopped / "checkpoint" / name).read_bytes() == (full / "checkpoint" / name).read_bytes(), name
    exported = (full / "final" / "trainable.safetensors").read_bytes()
    assert (stopped / "final" / "trainable.safetensors").read_bytes() == exported
    assert (stopped / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


@pytest.mark.parametrize("preset", [p for p in NEWER_PRESETS if (p, "bfloat16") not in RESUMED])
@pytest.mark.parametrize("kind", KINDS)
def test_method_trains_one_iteration_in_bfloat16(dirs, kind, preset, tmp_path):
    """One bfloat16 iteration (the tiny model, small and random: bf16 autocast) trains: ``train_checked`` and
    ``check_first_iteration`` (finite metrics, base weights untouched, LoRA moved, the old policy
    where there is one)."""
    cfg = method_config(preset, kind, dirs, tmp_path / "run", "bfloat16")
    assert_dtype(train_checked(cfg), "bfloat16")
    check_first_iteration(tmp_path / "run", cfg)
