"""The ``skill`` preset's iteration against this machine's sgemm rate (issue 27, "a cheaper iteration").

Prints the 1024² float32 sgemm rate (GFLOP/s at ``--threads``), the FLOPs of one skill iteration
(counted by ``torch.utils.flop_counter`` on one velocity call of the policy, times the iteration's
NFE: rollout forwards, and per trained transition a policy forward + backward (3×) plus the
reference forward of the KL), and for each LoRA forward — ``peft`` (before) and ``composed`` (after,
the built-in model's default) — the iteration's seconds per phase and its rate in GFLOP/s and as a
fraction of sgemm. Both forwards run the same iteration 0 of the same session (weights and optimizer
restored before each), alternating, ``--repeats`` times; the best of each is reported.

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/skill_rate.py --threads 2

Take figures from a quiet machine; the ratio of the two forwards, measured side by side, is the
robust number. The first line names the CPU (model, vector extensions, torch's kernel level), so rows
from different machines can stand in one table. ``--profile`` also runs one composed iteration under
``torch.profiler`` and prints its top operators by self CPU time, with their share and, for the
matmuls and convolutions, their rate.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
import types
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from flowcredit.presets import load_config
from flowcredit.run.lora_compose import composed_forward
from flowcredit.run.session import build_session
from flowcredit.train import grpo_iteration


def sgemm_gflops(n: int = 1024, trials: int = 5) -> float:
    """Best rate of an ``n × n`` float32 matmul, GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * n**3 / best / 1e9


VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> dict:
    """The CPU's model name, its vector extensions (from ``/proc/cpuinfo``'s flags) and the kernel
    level torch dispatches to."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {
        "model": model,
        "vector": [f for f in VECTOR_FLAGS if f in flags],
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def profile_iteration(s, top: int = 12) -> list[dict]:
    """One iteration under ``torch.profiler``: the ``top`` operators by self CPU time, each with its
    share of the total, calls, and (matmuls, convolutions) GFLOP/s from the profiler's FLOP counts."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        grpo_iteration(s, 0)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    rows = []
    for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        seconds = e.self_cpu_time_total / 1e6
        rate = e.flops / seconds / 1e9 if e.flops and seconds else None
        rows.append(
            {
                "op": e.key,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
                "s": seconds,
                "gflops": rate,
            }
        )
    return rows


def forward_flops_per_row(s) -> float:
    """FLOPs of one velocity call of the policy per row (CFG passes included), batch of 8 prompts."""
    prompts = [m["prompt"] for m in s.train_metas[:8]]
    cond = s.model.encode(prompts)
    x = torch.randn(len(prompts), *s.model.latent_shape)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        s.model.velocity(x, torch.full((len(prompts),), 0.5), cond)
    return counter.get_total_flops() / len(prompts)


def iteration_flops(metrics: dict, per_pass: float, passes: int, beta: float) -> float:
    """FLOPs of an iteration from its NFE (``nfe/*`` count network rows × CFG passes)."""
    rollout = (metrics["nfe/rollout"] + metrics["nfe/values"]) * per_pass / passes
    transitions = metrics["nfe/train"] / (2 if beta else 1)  # policy rows (× passes)
    update = transitions * (3 + (1 if beta else 0)) * per_pass / passes
    return rollout + update


def set_forward(net, composed: bool) -> None:
    """Bind the composed forward to every LoRA layer, or restore peft's."""
    from peft.tuners.lora import LoraLayer

    for layer in net.modules():
        if isinstance(layer, LoraLayer):
            if composed:
                layer.forward = types.MethodType(composed_forward, layer)
            else:
                layer.__dict__.pop("forward", None)


def arm_times(arms: list[str], threads: int, repeats: int) -> dict[str, float]:
    """Best iteration-0 seconds of the preset (``skill``) and of each arm of the skill comparison
    (``bench_skill.SKILL_ARMS``), composed forward, sessions built once and iterated alternately."""
    from flowcredit.commands.bench_skill import SKILL_ARMS

    overrides = ["--threads", str(threads), "--log_with", "none", "--eval_every", "0"]
    sessions, starts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        base = load_config("skill", None, overrides)
        for name in ["skill", *arms]:
            change = (
                SKILL_ARMS[name](base)
                if name != "skill" and callable(SKILL_ARMS[name])
                else SKILL_ARMS.get(name, [])
            )
            cfg = load_config("skill", None, [*overrides, *change, "--run_dir", str(Path(tmp) / name)])
            sessions[name] = build_session(cfg)
            starts[name] = (
                sessions[name].policy.trainable_state(),
                copy.deepcopy(sessions[name].optimizer.state_dict()),
            )
        best = {name: math.inf for name in sessions}
        for _ in range(repeats):
            for name, s in sessions.items():
                s.policy.load_trainable_state(starts[name][0])
                s.optimizer.load_state_dict(starts[name][1])
                t0 = time.perf_counter()
                grpo_iteration(s, 0)
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def upsample_times(threads: int, repeats: int) -> dict[str, float]:
    """Best iteration-0 seconds of the ``skill`` preset with the U-Net's nearest 2× upsampling as
    ``F.interpolate`` (before) and as ``tiny_net.upsample2x`` (after; the same numbers bit for bit),
    one session, weights and optimizer restored before each, alternating."""
    import torch.nn.functional as F

    from flowcredit.models import tiny_net

    fast = tiny_net.upsample2x
    ways = {"interpolate": lambda h: F.interpolate(h, scale_factor=2.0, mode="nearest"), "upsample2x": fast}
    overrides = ["--threads", str(threads), "--log_with", "none", "--eval_every", "0"]
    best = {name: math.inf for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        s = build_session(load_config("skill", None, [*overrides, "--run_dir", str(Path(tmp) / "run")]))
        state, opt = s.policy.trainable_state(), copy.deepcopy(s.optimizer.state_dict())
        try:
            for _ in range(repeats):
                for name, way in ways.items():
                    tiny_net.upsample2x = way
                    s.policy.load_trainable_state(state)
                    s.optimizer.load_state_dict(opt)
                    t0 = time.perf_counter()
                    grpo_iteration(s, 0)
                    best[name] = min(best[name], time.perf_counter() - t0)
        finally:
            tiny_net.upsample2x = fast
    return best


def optional_sections(args, profiled: list[dict], out: dict) -> None:
    """The ``--arms``, ``--upsample`` and ``--profile`` tables, each also stored in ``out``."""
    if args.arms:
        times = arm_times(args.arms.split(","), args.threads, args.repeats)
        print("\n| arm (composed forward) | iteration s | ÷ Flow-GRPO (skill) |\n|---|---|---|")
        for name, seconds in times.items():
            print(f"| {name} | {seconds:.2f} | {seconds / times['skill']:.2f}× |")
        out["arms"] = times
    if args.upsample:
        up = upsample_times(args.threads, args.repeats)
        print("\n| nearest 2× upsampling in the U-Net | iteration s |\n|---|---|")
        for name, seconds in up.items():
            print(f"| {name} | {seconds:.2f} |")
        print(f"\nupsample2x / interpolate time: {up['upsample2x'] / up['interpolate']:.3f}×")
        out["upsample"] = up
    if args.profile:
        print("\n| operator (one composed iteration) | self CPU share | calls | s | GFLOP/s |")
        print("|---|---|---|---|---|")
        for row in profiled:
            rate = f"{row['gflops']:.0f}" if row["gflops"] else ""
            print(f"| {row['op']} | {row['share']:.1%} | {row['calls']} | {row['s']:.2f} | {rate} |")
        out["profile"] = profiled


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.add_argument(
        "--arms", default="", help="also time these arms of the skill comparison, e.g. dense_euler1"
    )
    p.add_argument(
        "--later", default=None, help="with --arms: add them as one more run to this --out file's `later`"
    )
    p.add_argument("--profile", action="store_true", help="also profile one composed iteration by operator")
    p.add_argument("--upsample", action="store_true", help="also time F.interpolate against upsample2x")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["--threads", str(args.threads), "--log_with", "none", "--eval_every", "0"]
        cfg = load_config("skill", None, [*overrides, "--run_dir", str(Path(tmp) / "run")])
        s = build_session(cfg)
        passes = getattr(s, "guidance_passes", 1)
        per_row = forward_flops_per_row(s)
        state = s.policy.trainable_state()
        opt = copy.deepcopy(s.optimizer.state_dict())
        runs = {"peft": [], "composed": []}
        for _ in range(args.repeats):
            for name in runs:
                s.policy.load_trainable_state(state)
                s.optimizer.load_state_dict(opt)
                set_forward(s.model.net, name == "composed")
                s.sampling_copies = name == "composed"  # peft: the rollout on peft's forward too
                t0 = time.perf_counter()
                m = grpo_iteration(s, 0)
                runs[name].append((time.perf_counter() - t0, m))
        if args.profile:
            s.policy.load_trainable_state(state)
            s.optimizer.load_state_dict(opt)
            set_forward(s.model.net, True)
            s.sampling_copies = True
            profiled = profile_iteration(s)
    sgemm, cpu = sgemm_gflops(), cpu_description()
    print(f"CPU: {cpu['model']}; {' '.join(cpu['vector'])}; torch kernels {cpu['torch_capability']}")
    print(f"torch {torch.__version__}, {args.threads} threads; sgemm 1024² float32: {sgemm:.0f} GFLOP/s")
    print(f"policy forward: {per_row / 1e9:.3f} GFLOP per row (CFG passes included)\n")
    print("| LoRA forward | iteration s | rollout s | update s | GFLOP | GFLOP/s | of sgemm |")
    print("|---|---|---|---|---|---|---|")
    out = {"cpu": cpu, "threads": args.threads, "sgemm_gflops": sgemm, "forward_gflop_per_row": per_row / 1e9}
    for name, results in runs.items():
        seconds, m = min(results, key=lambda r: r[0])
        flops = iteration_flops(m, per_row, passes, cfg.beta)
        rate = flops / seconds / 1e9
        print(
            f"| {name} | {seconds:.2f} | {m['time/rollout_s']:.2f} | {m['time/update_s']:.2f} "
            f"| {flops / 1e9:.0f} | {rate:.0f} | {rate / sgemm:.0%} |"
        )
        out[name] = {"seconds": seconds, "gflop": flops / 1e9, "gflops": rate, "of_sgemm": rate / sgemm}
    print(f"\ncomposed / peft time: {out['composed']['seconds'] / out['peft']['seconds']:.2f}×")
    optional_sections(args, profiled if args.profile else [], out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    if args.later:
        add_later_run(Path(args.later), out)


def add_later_run(path: Path, out: dict) -> None:
    """Append this run's ``--arms`` (with ``skill`` timed beside them), its CPU, threads and date to the
    ``later`` runs of an earlier ``--out`` file (``benchmarks/skill_grid/skill_grid_plan.py``
    ``timed_seconds`` reads them), so that arms added to the grid later are timed without re-timing
    the published ones: each ratio to Flow-GRPO stays one run's."""
    if "arms" not in out:
        raise SystemExit("--later needs --arms: the arms to add, timed beside Flow-GRPO's iteration")
    times = json.loads(path.read_text())
    run = {"date": time.strftime("%Y-%m-%d"), "cpu": out["cpu"], "threads": out["threads"]}
    run["arms"] = out["arms"]
    times.setdefault("later", []).append(run)
    path.write_text(json.dumps(times, indent=1) + "\n")


if __name__ == "__main__":
    main()
