"""Exact resume after SIGKILL, and graceful SIGINT (subprocess runs of the CLI)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ARGS = [
    "--iterations",
    "4",
    "--prompts_per_iter",
    "2",
    "--group_size",
    "6",
    "--num_train_prompts",
    "4",
    "--num_eval_prompts",
    "2",
    "--eval_samples_per_prompt",
    "2",
    "--eval_every",
    "2",
    "--num_steps",
    "5",
    "--batch_size",
    "12",
    "--seed",
    "3",
]


def _start(run_dir: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "flowcredit", "train", *extra]
    if "--resume" not in extra:
        cmd += ["--run_dir", str(run_dir), *ARGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_iteration(run_dir: Path, proc: subprocess.Popen, iteration: int, timeout: float = 240) -> None:
    path = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if any(json.loads(x)["iteration"] >= iteration for x in lines):
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("timed out")


def _finish(proc: subprocess.Popen) -> str:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def test_sigkill_then_resume_reproduces_metrics_exactly(tmp_path):
    full, broken = tmp_path / "full", tmp_path / "broken"
    _finish(_start(full))
    proc = _start(broken)
    _wait_for_iteration(broken, proc, 2)
    time.sleep(0.3)  # land inside iteration 3 (or its checkpoint write)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (broken / "summary.json").exists()
    _finish(_start(broken, "--resume", str(broken)))
    assert (broken / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_sigint_stops_gracefully_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = _start(run)
    _wait_for_iteration(run, proc, 1)
    proc.send_signal(signal.SIGINT)
    out = _finish(proc)
    state = json.loads((run / "checkpoint" / "state.json").read_text())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert state["iteration"] == lines[-1]["iteration"] < 4
    assert (run / "final" / "model.safetensors").exists() and "flowcredit:" in out
