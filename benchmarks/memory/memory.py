"""Speed and memory of one update micro-batch (LoRA forward + backward of ``velocity``) with the
``gradient_checkpointing`` and ``compile`` options, on the built-in tiny model and a tiny random SD3
pipeline (``tests/tiny_diffusers.py``), on the CPU.

    flock /tmp/flowcredit-torch.lock python benchmarks/memory/memory.py \\
        --out benchmarks/results/memory_cpu.json

Every (model, option) pair runs in a fresh subprocess, one after the other in one invocation, with one
torch thread. Per pair: the first call (``compile`` compiles there), the median of ``--reps`` timed
calls (wall clock and CPU time), the activation bytes the forward saves for the backward
(``saved_tensors_hooks``, unique storages that are not parameters; exact, but not measurable under
``compile``, whose graphs save their own), and the peak RSS growth over the timed calls (sampled
every millisecond; glibc is told to return every block over 64 KiB when freed, so the RSS follows
the live tensors: activations, gradients and the allocator's slack).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OPTIONS = {
    "base": {},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "compile": {"compile": True},
    "both": {"gradient_checkpointing": True, "compile": True},
}
MODELS = {"tiny": (32, "unet"), "sd3": (16, "default")}  # rows per micro-batch, LoRA targets
PROMPTS = ["a red square", "a blue circle", "a green triangle", "a yellow square"]  # both vocabularies


def build(kind: str, workdir: Path):
    if kind == "tiny":
        from flowcredit.models import load_builtin

        return load_builtin()
    sys.path.insert(0, str(REPO / "tests"))
    from tiny_diffusers import build_sd3

    from flowcredit.models.sd3 import SD3FlowModel

    # 64 px: latents 4×32×32, 256 image tokens per row (the tiny transformer's largest position grid)
    pipe_dir = str(build_sd3(workdir / "sd3"))
    return SD3FlowModel.from_pretrained(pipe_dir, dtype="float32", device="cpu", resolution=64)


class PeakRss:
    """Peak resident set size (bytes) over a ``with`` block, sampled every millisecond."""

    def __enter__(self):
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def saved_activation_bytes(model, step_inputs, params) -> int:
    """Bytes of the unique non-parameter tensors the forward saves for the backward."""
    import torch

    param_ptrs = {p.data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in param_ptrs:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        v = model.velocity(*step_inputs)
    v.square().mean().backward()
    return sum(seen.values())


def child(kind: str, option: str, reps: int) -> dict:
    """One (model, option) measurement in this process."""
    import torch

    from flowcredit.config import Config
    from flowcredit.run.policy import Policy
    from flowcredit.run.session import configure_network

    torch.set_num_threads(1)
    rows, targets = MODELS[kind]
    with tempfile.TemporaryDirectory() as tmp:
        model = build(kind, Path(tmp))
    policy = Policy(model, "lora", 4, 4.0, targets, seed=0)
    configure_network(Config(**OPTIONS[option]), model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn((rows, *model.latent_shape), generator=g)
    inputs = (x, torch.rand(rows, generator=g), model.encode([PROMPTS[i % 4] for i in range(rows)]))

    def step() -> tuple[float, float]:
        """Wall-clock and CPU seconds of one forward + backward (one thread: CPU time is the less
        disturbed by other jobs on a shared machine)."""
        t0, c0 = time.perf_counter(), time.process_time()
        model.velocity(*inputs).square().mean().backward()
        for p in policy.parameters():
            p.grad = None
        return time.perf_counter() - t0, time.process_time() - c0

    first, _ = step()
    step()
    compiled = "compile" in OPTIONS[option]
    saved = None if compiled else saved_activation_bytes(model, inputs, policy.parameters())
    with PeakRss() as rss:
        times = [step() for _ in range(reps)]
    return {
        "model": kind,
        "option": option,
        "rows": rows,
        "first_call_s": first,
        "step_s": statistics.median(wall for wall, _ in times),
        "step_cpu_s": statistics.median(cpu for _, cpu in times),
        "saved_activations_MiB": None if saved is None else saved / 2**20,
        "peak_rss_growth_MiB": (rss.peak - rss.start) / 2**20,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "OPTION"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.reps)))
        return
    # glibc returns blocks over 64 KiB to the system when freed, so the RSS follows live tensors
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = []
    for kind in MODELS:
        for option in OPTIONS:
            cmd = [sys.executable, __file__, "--child", kind, option, "--reps", str(args.reps)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                error = (proc.stderr.strip().splitlines() or ["?"])[-1]
                results.append({"model": kind, "option": option, "error": error})
            else:
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
