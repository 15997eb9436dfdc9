"""bf16 autocast vs float32: seconds per iteration of a preset on the built-in model, side by side.

Each mode builds its own session and runs ``--warmup`` untimed iterations, then the modes take turns
(fp32, bf16, fp32, bf16, …) so drifting machine load hits both alike; the table gives the median.
Only CPUs with AMX / AVX512-bf16 (and GPUs) gain: on AVX2-only CPUs bf16 is many times slower.

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/autocast.py    # ≈ 2 min, skill
    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/autocast.py --preset demo --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from flowcredit.presets import load_config
from flowcredit.run.session import build_session
from flowcredit.train import grpo_iteration

MODES = {"float32": ["--autocast", "false"], "bf16 autocast": ["--autocast", "true"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="skill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations per mode")
    p.add_argument("--repeats", type=int, default=3, help="timed iterations per mode")
    args = p.parse_args()
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for mode, flags in MODES.items():
            common = ["--threads", str(args.threads), "--eval_every", "0", "--run_dir", f"{tmp}/{mode[:4]}"]
            sessions[mode] = build_session(load_config(args.preset, None, flags + common), resume=False)
            for i in range(args.warmup):
                grpo_iteration(sessions[mode], i)
        for i in range(args.warmup, args.warmup + args.repeats):
            for mode, session in sessions.items():
                t0 = time.perf_counter()
                grpo_iteration(session, i)
                seconds[mode].append(time.perf_counter() - t0)
    median = {mode: statistics.median(s) for mode, s in seconds.items()}
    print(f"\n{args.preset}, {args.threads} threads, median of {args.repeats} iterations per mode\n")
    print("| mode | s / iteration | every timing |\n|---|---|---|")
    for mode, s in seconds.items():
        print(f"| {mode} | {median[mode]:.2f} | {', '.join(f'{t:.2f}' for t in s)} |")
    print(f"\nfloat32 / bf16: {median['float32'] / median['bf16 autocast']:.2f}×")


if __name__ == "__main__":
    main()
