"""Exact resume. Every preset (with EMA, β, and its own ψ / turning points; the newer methods with
their per-iteration plans and the old policy of AWM and DiffusionNFT) killed inside a checkpoint write
resumes to the uninterrupted run's metrics, checkpoint and final weights, bit for bit; so does each
point of the write and rename; and through the command line, a real SIGKILL and a Ctrl-C. The
failures are injected at known points (tests/kill_points.py), never timed with a sleep. The runs use a
small randomly initialised model (the claim does not depend on the weights), checked to train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kill_points import POINTS, Killed, install
from loop_probes import small_config, small_model
from safetensors.torch import load_file

from flowcredit.presets import NEWER_PRESETS, PRESETS
from flowcredit.run.checkpoint import find_checkpoint, load_checkpoint
from flowcredit.train import train
from flowcredit.updates import UPDATES

pytestmark = pytest.mark.slow

RESUME = dict(iterations=3, eval_every=2, ema_decay=0.9, beta=0.01)
KILLED_AT = 2  # the checkpoint write of iteration 2 fails
# the checkpoint a resume finds after a failure at each point
RESUMES_FROM = {"after_trainable": 1, "before_swap": 1, "between_renames": 1, "before_cleanup": 2}
# every preset, each at one point in turn; then tp_grpo at the other points
CASES = [(p, POINTS[k % len(POINTS)]) for k, p in enumerate(PRESETS)]
CASES += [("tp_grpo", p) for p in POINTS if ("tp_grpo", p) not in CASES]
# plans that change with every iteration, so that the resumed iterations must draw their own: TempFlow's
# branch step cycles (one branch per iteration, also the tiny size), MixGRPO's window moves each iteration;
# AWM's and DiffusionNFT's old policy moves by η = 0.3 / 0.2 per optimizer step (not 0.001: an old policy
# restored wrong would hardly show), AWM at 2 time draws
EXTRA = {
    "tempflow_grpo": {"step_schedule_options": '{"branches": "cycle"}'},
    "mixgrpo": {"step_schedule_options": '{"size": 2, "interval": 1}'},
    "awm": {"update_options": '{"time_draws": 2, "old_decay_rate": 0.3}'},
    "diffusion_nft": {"update_options": '{"old_decay_rate": 0.2}'},
    "tree_grpo": {"group_size": 4, "step_schedule_options": '{"fanout": 2, "depth": 2}'},  # 4 leaves
    "branch_grpo": {"group_size": 4, "step_schedule_options": '{"splits": [0, 2]}'},  # 4 leaves
}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    """A small random tiny model (``loop_probes.small_model``): exact resume does not depend on the
    weights, and the matrix takes 71 s on it against about 5 minutes on the built-in model."""
    return small_model(tmp_path_factory.mktemp("model") / "tiny16")


def resume_config(preset: str, run: Path, model: str):
    return small_config(preset, run, checkpoint=model, **RESUME, **EXTRA.get(preset, {}))


def test_every_newer_preset_is_resumed():
    assert set(NEWER_PRESETS) <= {p for p, _ in CASES}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, model):
    """The uninterrupted run of a preset (made once per preset)."""
    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            run = tmp_path_factory.mktemp("full") / preset
            train(resume_config(preset, run, model))
            cache[preset] = run
        return cache[preset]

    return get


def assert_same_run(want: Path, got: Path) -> None:
    """Same metrics.jsonl bytes, same last checkpoint (weights, optimizer, EMA, old policy, ψ), same
    export."""
    assert (got / "metrics.jsonl").read_text() == (want / "metrics.jsonl").read_text()
    a, b = load_checkpoint(want / "checkpoint"), load_checkpoint(got / "checkpoint")
    assert a["iteration"] == b["iteration"] == RESUME["iterations"] and a["extra"] == b["extra"]
    for key in ("trainable", "ema", "old"):  # old: the old policy of a forward-process update rule
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][k], b[key][k]) for k in a[key])
    assert all(
        torch.equal(a["optimizer"]["state"][p][k], v)
        for p in b["optimizer"]["state"]
        for k, v in b["optimizer"]["state"][p].items()
        if torch.is_tensor(v)
    )
    fa, fb = (
        load_file(want / "final" / "trainable.safetensors"),
        load_file(got / "final" / "trainable.safetensors"),
    )
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    assert any(fa[k].abs().max() > 0 for k in fa if "lora_B" in k), "the run never moved (LoRA B starts at 0)"


@pytest.mark.parametrize(("preset", "point"), CASES)
def test_killed_in_a_checkpoint_write_resumes_exactly(preset, point, full_run, model, tmp_path, monkeypatch):
    want = full_run(preset)
    run = tmp_path / "run"
    cfg = resume_config(preset, run, model)
    install(point, KILLED_AT, "raise", monkeypatch.setattr)
    with pytest.raises(Killed):
        train(cfg)
    monkeypatch.undo()
    assert not (run / "summary.json").exists()
    found = find_checkpoint(run)
    assert json.loads((found / "state.json").read_text())["iteration"] == RESUMES_FROM[point]
    train(cfg, resume=True)
    assert_same_run(want, run)
    # a forward-process rule checkpoints its old policy (compared above), the others have none
    assert (load_checkpoint(run / "checkpoint")["old"] is None) == (UPDATES[cfg.update].old_decay is None)


# --- through the command line: a real SIGKILL, and Ctrl-C ------------------------------------------

CLI_ARGS = [
    "--preset", "tp_grpo", "--iterations", "3", "--prompts_per_iter", "2", "--group_size", "6",
    "--num_train_prompts", "4", "--num_eval_prompts", "2", "--eval_samples_per_prompt", "2",
    "--eval_every", "2", "--num_steps", "5", "--batch_size", "12", "--seed", "3", "--ema_decay", "0.9",
    "--beta", "0.01", "--log_with", "none", "--window_size", "0",
]  # fmt: skip


def _cli(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run python code with tests/ importable (a generous timeout: it only catches a hang)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parent)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )


def _train(run: Path, model: str, *extra: str, kill: str = "") -> subprocess.CompletedProcess:
    new = ["train", "--run_dir", str(run), "--checkpoint", model, *CLI_ARGS]
    argv = ["train", *extra] if "--resume" in extra else new
    if kill:
        code = f"import kill_points; kill_points.run_cli({kill!r}, {KILLED_AT}, 'sigkill', {argv!r})"
    else:
        code = f"import sys; from flowcredit.cli import main; sys.exit(main({argv!r}))"
    return _cli(code)


def test_sigkill_between_the_renames_then_resume_reproduces_the_run(model, tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    done = _train(full, model)
    assert done.returncode == 0, done.stdout + done.stderr
    killed = _train(broken, model, kill="between_renames")
    assert killed.returncode == -9, killed.stdout + killed.stderr
    assert not (broken / "checkpoint").exists() and (broken / "checkpoint.old").exists()
    resumed = _train(broken, model, "--resume", str(broken))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (broken / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_ctrl_c_stops_after_the_iteration_with_a_checkpoint(model, tmp_path):
    run = tmp_path / "run"
    argv = ["train", "--run_dir", str(run), "--checkpoint", model, *CLI_ARGS]
    code = (
        "import sys, kill_points; kill_points.interrupt_after(1); "
        f"from flowcredit.cli import main; sys.exit(main({argv!r}))"
    )
    proc = _cli(code)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert state["iteration"] == lines[-1]["iteration"] == 2  # the iteration in flight finishes
    assert (run / "final" / "model.safetensors").exists() and "flowcredit:" in proc.stdout + proc.stderr
