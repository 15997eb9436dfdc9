"""Two data-parallel processes on the CPU through torchrun + accelerate (DDP over gloo).

One set of runs (module fixture) serves every check: a 2-process run, the same run stopped after
iteration 1 and resumed, and a 1-process run, all with ``global_std`` (the advantage statistics of
the whole batch, gathered over ranks). ``batch_size`` is the rows of one rank, so the 1-process run
chunks its forward passes as each rank does and the two runs differ only by how the gradients are
summed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from flowcredit.run.micro_batches import micro_batches

TRAIN = "--prompts_per_iter 2 --group_size 6 --num_train_prompts 4 --num_eval_prompts 2".split()
TRAIN += "--eval_samples_per_prompt 1 --eval_every 0 --num_steps 5 --batch_size 6 --global_std true".split()
ROUND_OFF = 1e-4
"""Bound on the 2- vs 1-process weight difference of two runs with the same LoRA forward: a tenth of
one Adam step at the preset's lr 1e-3 (a rank drawing its own noise, a real bug, differed by 1.2e-3).
Why it holds on any CPU: between the same forwards the processes change only which rows share a
matmul and the order of the gradient sums, measured (max abs, after 2 iterations) 1.6e-7 to 2.6e-5
on AMD Zen 3 (AVX2) and Zen 4 (AVX-512) machines, each kernel set forced on one of them
(``ATEN_CPU_CAPABILITY=default``/``avx2``/``avx512``: ≤ 2.0e-6; ``make test-kernels``): 4× below at
the worst. What Adam magnifies up to the bound is a different forward (composed vs peft LoRA: 6.8e-5
to 1.9e-4, on an Intel Xeon with AMX 1.2e-4), so no comparison here mixes forwards (docs/testing.md)."""
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(cmd: list[str], extra_env: dict | None = None) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(extra_env or {})}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def two_process_runs(root, env: dict | None = None, extra: tuple[str, ...] = ()):
    """``root/two``: 2 processes, 2 iterations; ``root/resumed``: 2 processes stopped after 1,
    resumed to 2 (``env``, ``extra``: more environment and arguments, e.g. test_fsdp.py's sharding)."""
    train = ["-m", "flowcredit", "train"]
    _run([*TORCHRUN, *train, "--run_dir", str(root / "two"), "--iterations", "2", *TRAIN, *extra], env)
    _run([*TORCHRUN, *train, "--run_dir", str(root / "resumed"), "--iterations", "1", *TRAIN, *extra], env)
    _run([*TORCHRUN, *train, "--resume", str(root / "resumed"), "--iterations", "2"], env)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_process_run):
    """``two`` and ``resumed`` (:func:`two_process_runs`, DDP); ``one``: the 1-process run."""
    root = two_process_runs(tmp_path_factory.mktemp("multiprocess"))
    (root / "one").symlink_to(one_process_run)
    return root


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _weights(run) -> dict:
    return load_file(str(run / "final" / "trainable.safetensors"))


@pytest.mark.slow
def test_two_processes_keep_equal_weights_and_log_once(runs):
    lines = _metrics(runs / "two")
    trained = [x for x in lines if "stats/optimizer_steps" in x]
    assert [x["iteration"] for x in lines] == [0, 1, 2] and len(trained) == 2
    for x in trained:
        assert x["dist/param_maxdiff"] == 0.0  # DDP's all-reduce leaves every rank the same weights
        assert x["loss/policy"] == x["loss/policy"] and abs(x["loss/policy"]) < 1e3
    assert (runs / "two" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_two_processes_train_the_one_process_weights(runs):
    """The process count does not change the result: every draw depends on the seed and the row
    alone, and global_std sees the gathered batch, so the runs differ by round-off only (which rows
    share a matmul, the order of the gradient sums), magnified by Adam on near-zero gradients. Both
    runs use the same LoRA forward (``auto``: composed on the built-in model); see ``ROUND_OFF``."""
    two, one = _weights(runs / "two"), _weights(runs / "one")
    assert set(two) == set(one)
    assert max((two[k] - one[k]).abs().max().item() for k in one) <= ROUND_OFF
    rewards = [x["reward/mean"] for x in _metrics(runs / "one") if "reward/mean" in x]
    assert rewards == pytest.approx([x["reward/mean"] for x in _metrics(runs / "two") if "reward/mean" in x])


@pytest.mark.slow
def test_two_process_resume_is_exact(runs):
    two, resumed = _weights(runs / "two"), _weights(runs / "resumed")
    assert all(torch.equal(two[k], resumed[k]) for k in two)
    # the stopped run evaluated at its stop; every training number is the uninterrupted run's
    drop_eval = [{k: v for k, v in x.items() if not k.startswith("eval/")} for x in _metrics(runs / "two")]
    assert drop_eval == [
        {k: v for k, v in x.items() if not k.startswith("eval/")} for x in _metrics(runs / "resumed")
    ]


def test_micro_batches_weigh_rows_over_all_ranks_and_sync_once():
    keep = torch.arange(5)
    units = micro_batches([3, 1], {3: keep, 1: keep}, 2, n_rows={3: 8, 1: 8}, world=2)  # 5 of 8 rows here
    assert [(i, r.tolist()) for i, r, _, _ in units] == [
        (3, [0, 1]),
        (3, [2, 3]),
        (3, [4]),
        (1, [0, 1]),
        (1, [2, 3]),
        (1, [4]),
    ]
    assert [w for *_, w, _ in units] == [0.25, 0.25, 0.125] * 2  # |r| / 8 / 2 · 2
    assert [s for *_, s in units] == [False] * 5 + [True]  # one all-reduce per optimizer step
    # a rank without kept rows still joins the all-reduce, with a zero-weight pass
    empty = torch.zeros(0, dtype=torch.long)
    (only,) = micro_batches([2, 4], {2: empty, 4: empty}, 2, n_rows={2: 8, 4: 8}, world=2)
    assert only[0] == 2 and only[1].tolist() == [0] and only[2] == 0.0 and only[3]
    # steps trained by different rows (branch plans): each step's rows weigh over that step's count
    units = micro_batches(
        [0, 2], {0: torch.tensor([0, 2]), 2: torch.tensor([1])}, 4, n_rows={0: 4, 2: 1}, world=1
    )
    assert [(i, r.tolist(), w) for i, r, w, _ in units] == [(0, [0, 2], 0.25), (2, [1], 0.5)]
