"""Two data-parallel processes on the CPU through torchrun + accelerate (gloo)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_two_processes_keep_identical_parameters(tmp_path):
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "flowcredit",
        "train",
        "--run_dir",
        str(run),
        "--iterations",
        "2",
        "--prompts_per_iter",
        "2",
        "--group_size",
        "6",
        "--num_train_prompts",
        "4",
        "--num_eval_prompts",
        "2",
        "--eval_samples_per_prompt",
        "1",
        "--eval_every",
        "0",
        "--num_steps",
        "5",
        "--batch_size",
        "12",
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "stats/optimizer_steps" in x]
    assert [x["iteration"] for x in lines] == [0, 1, 2] and trained
    for x in trained:
        assert x["dist/param_maxdiff"] == 0.0
        assert x["loss/policy"] == x["loss/policy"] and abs(x["loss/policy"]) < 1e3
    assert (run / "final" / "model.safetensors").exists()
