"""Ctrl-C from outside a real training process, and what a run says about itself.

A ``flowcredit train`` process gets SIGINT once it has checkpointed iteration 1. The first Ctrl-C is
acknowledged on stderr at once and the run stops after the iteration in flight, checkpointed, its
summary marked stopped early; a second one stops the process at once, its last checkpoint loadable,
and ``--resume`` to the full count reproduces the uninterrupted run's metrics.jsonl and final weights
byte for byte. Then the run's clock over a resume, the summary's wording, the progress bar's label, and
the start note of a run evaluated without CFG. The runs use a small random tiny model
(``loop_probes.small_model``) at about half a second an iteration.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loop_probes import small_model
from safetensors.torch import load_file

from flowcredit.commands.train import resume_config
from flowcredit.presets import PRESETS, load_config
from flowcredit.run.checkpoint import find_checkpoint, load_checkpoint
from flowcredit.run.outputs import format_summary, run_label, start_notes
from flowcredit.run.runlog import earlier_seconds
from flowcredit.run.stopping import ACKNOWLEDGED
from flowcredit.train import train

ITERATIONS = 4
ARGS = [
    "--iterations", str(ITERATIONS), "--prompts_per_iter", "2", "--group_size", "12",
    "--num_train_prompts", "4", "--num_eval_prompts", "2", "--eval_samples_per_prompt", "2",
    "--eval_every", "1", "--num_steps", "5", "--window_size", "0", "--batch_size", "24",
    "--reward", "reward_fixtures:brightness", "--log_with", "none", "--threads", "1", "--seed", "5",
]  # fmt: skip
"""The demo preset at test size; ``eval_every`` 1, so that the evaluation a stop adds to its last
iteration is one an uninterrupted run makes too."""


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return small_model(tmp_path_factory.mktemp("model") / "tiny16")


def _config(run: Path, model: str):
    return load_config("demo", None, [*ARGS, "--checkpoint", model, "--run_dir", str(run)])


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, model) -> Path:
    """The uninterrupted run, in this process."""
    run = tmp_path_factory.mktemp("full") / "run"
    train(_config(run, model))
    return run


def _start(run: Path, model: str, tmp: Path) -> tuple[subprocess.Popen, Path, Path]:
    """``python -m flowcredit train --preset demo …`` with its stdout and stderr in files; returns once it
    has checkpointed iteration 1 (the process in iteration 2 or later)."""
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(Path(__file__).parent)}
    argv = [sys.executable, "-m", "flowcredit", "train", "--preset", "demo", *ARGS]
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(
            [*argv, "--checkpoint", model, "--run_dir", str(run)], stdout=fo, stderr=fe, env=env
        )
    state = run / "checkpoint" / "state.json"
    deadline = time.time() + 120
    while not (state.exists() and json.loads(state.read_text() or "{}").get("iteration", 0) >= 1):
        assert proc.poll() is None, err.read_text()
        assert time.time() < deadline, "no checkpoint of iteration 1 in 120 s"
        time.sleep(0.01)
    return proc, out, err


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float = 10) -> float:
    """Seconds until ``text`` shows in the file ``path``."""
    t0 = time.time()
    while text not in path.read_text():
        assert time.time() - t0 < timeout and proc.poll() is None, path.read_text()
        time.sleep(0.005)
    return time.time() - t0


def _same_as_full(full: Path, run: Path) -> None:
    assert (run / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    want, got = (load_file(str(r / "final" / "trainable.safetensors")) for r in (full, run))
    assert want.keys() == got.keys() and all(want[k].equal(got[k]) for k in want)
    assert any(want[k].abs().max() > 0 for k in want if "lora_B" in k), (
        "the run never moved (LoRA B starts at 0)"
    )


def test_ctrl_c_twice_stops_now_and_the_run_resumes_exactly(full_run, model, tmp_path):
    run = tmp_path / "run"
    proc, _, err = _start(run, model, tmp_path)
    proc.send_signal(signal.SIGINT)
    assert _wait_for(err, ACKNOWLEDGED, proc) < 2  # at once, not after the iteration
    t0 = time.time()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=30)
    assert time.time() - t0 < 5, f"{time.time() - t0:.1f} s to stop"
    assert rc == 130, err.read_text()  # KeyboardInterrupt: the shell's status for SIGINT, quietly
    assert "stopping now" in err.read_text() and "Traceback" not in err.read_text()
    assert not (run / "summary.json").exists()
    found = find_checkpoint(run)
    state = load_checkpoint(found)
    assert 1 <= state["iteration"] < ITERATIONS and state["trainable"]
    train(resume_config(str(run), []), resume=True)
    _same_as_full(full_run, run)


def test_ctrl_c_once_stops_after_the_iteration(full_run, model, tmp_path):
    run = tmp_path / "run"
    proc, out, err = _start(run, model, tmp_path)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, err.read_text()
    assert err.read_text().count(ACKNOWLEDGED) == 1
    summary = json.loads((run / "summary.json").read_text())
    done = summary["iterations"]
    assert summary["stopped_early"] == {"by": "Ctrl-C", "iterations": ITERATIONS} and 2 <= done < ITERATIONS
    assert load_checkpoint(find_checkpoint(run))["iteration"] == done  # the iteration in flight finished
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["iteration"] == done and "eval/test/soft" in rows[-1]
    text = out.read_text()
    assert f"train turning_point: stopped after {done} of {ITERATIONS}" in text
    assert f"stopped early by Ctrl-C after {done} of {ITERATIONS} iterations" in text
    first = summary["minutes"]
    summary = train(resume_config(str(run), []), resume=True)
    _same_as_full(full_run, run)
    assert "stopped_early" not in summary and summary["minutes"] > first  # both processes' time


def test_run_time_adds_up_over_a_resume(model, tmp_path, capsys):
    run = tmp_path / "run"
    cfg = _config(run, model)
    cfg.iterations = 1
    first = train(cfg)
    out = capsys.readouterr().out
    assert "flowcredit: 1 iteration of turning_point in" in out and "train turning_point: 100%" in out
    timings = run / "timings.jsonl"
    before = earlier_seconds(timings)
    assert abs(before - first["minutes"] * 60) < 1.0  # the clock at the last logged iteration
    t0 = time.time()
    second = train(resume_config(str(run), ["--iterations", "2"]), resume=True)
    assert before + (time.time() - t0) >= second["minutes"] * 60 > before
    assert "2 iterations of turning_point" in capsys.readouterr().out


def test_a_run_from_before_the_clock_counts_its_iterations(tmp_path):
    rows = [{"iteration": 1, "time/iteration_s": 2.0}, {"iteration": 2, "time/iteration_s": 3.5}]
    path = tmp_path / "timings.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert earlier_seconds(path) == 5.5
    path.write_text("".join(json.dumps({**r, "time/run_s": 9.0 * r["iteration"]}) + "\n" for r in rows))
    assert earlier_seconds(path) == 18.0
    assert earlier_seconds(tmp_path / "missing.jsonl") == 0.0


def test_summary_counts_iterations_in_words():
    one = format_summary({"iterations": 1, "minutes": 0.5}, "turning_point", "runs/x")
    assert one.startswith("flowcredit: 1 iteration of turning_point in 0.5 min")
    assert "4 iterations of grpo_guard" in format_summary(
        {"iterations": 4, "minutes": 1.65}, "grpo_guard", "r"
    )


def test_label_names_the_credit_and_update_rules():
    assert run_label(PRESETS["demo"]()) == "turning_point"
    assert run_label(PRESETS["grpo_guard"]()) == "flow_grpo+ratio_norm"
    assert run_label(PRESETS["diffusion_nft"]()) == "flow_grpo+nft"


def test_start_note_for_evaluation_without_cfg():
    noted = {name for name, make in PRESETS.items() if start_notes(make())}
    assert noted == {"diffusion_nft", "awm"}  # guidance_scale 1: sampled and evaluated without CFG
    cfg = PRESETS["diffusion_nft"]()
    cfg.eval_guidance_scale = 2.0
    assert not start_notes(cfg)
    cfg = PRESETS["flow_grpo"]()
    cfg.eval_guidance_scale = 1.0
    assert "(eval_guidance_scale 1)" in start_notes(cfg)[0]
