"""Cost of a GRPO iteration against its compute floor (docs/benchmarks.md, "Cost model"), on this machine.

1. Peak rate of the built-in model: samples·forward/s of ``model.velocity`` over batch sizes, with CFG
   as the trainer runs it (guided: both branches in one batch, counted twice, as ``nfe/*`` counts);
   beside it, the same for the training policy (the model with unmerged LoRA, as rollouts run it).
2. Per preset, one iteration's wall time ÷ its NFE floor (``nfe/rollout + nfe/values + nfe/train`` of
   that iteration ÷ the peak rate), with the time split into rollout, value completions, reward
   (decode + score) and the PPO update. The update's NFE are forward passes that also run a backward,
   so its ratio cannot approach 1 under this definition of the floor.
3. Batched lock-step completions (``flowcredit.values.complete`` over every state of every trajectory
   at once) vs completing each state alone: wall-time ratio at equal NFE.

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/throughput.py
    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/throughput.py --profile dense_grpo

Small settings (``--prompts 2 --group 8``, N = 10, ``dense_grpo`` without calibration, which changes
ψ but not the cost) keep the whole script near three minutes on 2 cores. Timings vary run to run.
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from flowcredit.commands import bench
from flowcredit.models.tiny import load_builtin
from flowcredit.presets import COMPARED_PRESETS, load_config
from flowcredit.run.policy import Policy
from flowcredit.run.rollout import chunked_velocity
from flowcredit.run.session import build_session
from flowcredit.schedule import sigmas as make_sigmas
from flowcredit.tasks.shapes import load_prompts
from flowcredit.train import grpo_iteration
from flowcredit.values import complete


def forward_rate(model, b: int, samples: int = 256, trials: int = 2) -> float:
    """samples·forward/s of ``model.velocity`` at ``b`` prompts per call (CFG counted twice): best of
    ``trials`` timings of about ``samples`` samples each, after a warm-up call (kernel selection)."""
    mult = 1 if model.guidance_scale == 1.0 else 2
    cond = model.encode([load_prompts("train")[0]["prompt"]] * b)
    x, sigma = torch.randn(b, *model.latent_shape), torch.full((b,), 0.5)
    calls, best = max(2, samples // (b * mult)), math.inf
    with torch.no_grad():
        model.velocity(x, sigma, cond)
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(calls):
                model.velocity(x, sigma, cond)
            best = min(best, time.perf_counter() - t0)
    return b * mult * calls / best


def peak_rates(batch_sizes: list[int]) -> dict[int, tuple[float, float]]:
    """Per batch size: the built-in model's rate, and the rate of the training policy (LoRA r = 4 on
    the U-Net as the presets train it, not merged), which rollouts and updates run (value completions
    and evaluation run merged: ``Policy.merged``)."""
    base, policy_model = load_builtin(), load_builtin()
    Policy(policy_model, "lora", 4, 4.0, "default", need_reference=False, seed=0)
    return {b: (forward_rate(base, b), forward_rate(policy_model, b)) for b in batch_sizes}


def small_config(name: str, run_dir: Path, prompts: int, group: int, demo: bool = False):
    """A preset, or a bench row ``preset-variant`` (e.g. ``tp_grpo-euler1``: ``bench.CHEAP``), at small
    settings; ``demo``: with the demo task's recipe (4 prompts × 12, a window of 5 steps)."""
    preset, _, variant = name.partition("-")
    overrides = bench.TASKS["demo"]() if demo else []
    overrides += ["--prompts_per_iter", str(prompts), "--group_size", str(group), "--num_train_prompts", "8"]
    overrides += ["--run_dir", str(run_dir), "--eval_every", "0", "--num_eval_prompts", "2"]
    if variant:
        known = {**bench.ABLATIONS.get(preset, {}), **bench.CHEAP.get(preset, {})}
        if variant not in known or callable(known[variant]):
            raise SystemExit(f"throughput: no bench row {name!r} (variants of {preset}: {sorted(known)})")
        overrides += known[variant]
    if preset == "dense_grpo":
        overrides += ["--calibrate", "false"]  # calibration sets ψ (noise levels), not the cost
    return load_config(preset, None, overrides)


def iteration_cost(
    preset: str, peak: float, prompts: int, group: int, merged_values: bool = True, demo: bool = False
) -> dict:
    """The first iteration of ``preset`` (one-off kernel selection included: about 0–10 % here):
    seconds per phase, NFE, ratio to the floor. ``merged_values=False`` runs the value completions
    on the unmerged LoRA policy, as the trainer did before it merged them (the before/after row)."""
    with tempfile.TemporaryDirectory() as tmp:
        s = build_session(small_config(preset, Path(tmp) / "run", prompts, group, demo), resume=False)
        if not merged_values:
            s.policy.merged = nullcontext
        t0 = time.perf_counter()
        m = grpo_iteration(s, 0)
        total = time.perf_counter() - t0
    nfe = {k: m[f"nfe/{k}"] for k in ("rollout", "values", "train")}
    # the trainer's own phase clock; "values" = completions + decode + the reward wait
    times = {k: m[f"time/{k}_s"] for k in ("rollout", "values", "reward")}
    times["ppo_update"] = m["time/update_s"]
    floor = sum(nfe.values()) / peak
    name = preset if merged_values else f"{preset} (unmerged values: before)"
    return {"preset": name, "seconds": total, "nfe": nfe, "floor": floor, "ratio": total / floor, **times}


def lockstep_vs_separate(trajectories: int, batch_size: int = 64) -> dict:
    """Completions from states 0 … N−1 of ``trajectories`` rollouts: all at once vs one state at a time."""
    cfg = load_config("dense_grpo", None, ["--calibrate", "false"])
    model = load_builtin()
    prompt = load_prompts("train")[0]["prompt"]
    sigmas = make_sigmas(cfg.num_steps)
    n = cfg.num_steps
    with torch.no_grad():
        cond = model.encode([prompt])
        rows = torch.zeros(trajectories * n, dtype=torch.long)
        x = torch.randn(trajectories * n, *model.latent_shape, generator=torch.Generator().manual_seed(0))
        start = torch.arange(n).repeat(trajectories)  # (T·N,) state index of each row
        mult = 1 if model.guidance_scale == 1.0 else 2
        count = {"batched": 0, "separate": 0}

        def velocity(key):
            def v(xs, sigma, live):
                count[key] += xs.shape[0] * mult
                return chunked_velocity(model, xs, sigma, cond, rows[live], batch_size)

            return v

        t0 = time.perf_counter()
        batched = complete(velocity("batched"), x, sigmas, start, with_rows=True)
        t_batched = time.perf_counter() - t0
        t0 = time.perf_counter()
        separate = torch.cat(
            [
                complete(velocity("separate"), x[j : j + 1], sigmas, start[j : j + 1], with_rows=True)
                for j in range(len(x))
            ]
        )
        t_separate = time.perf_counter() - t0
    assert count["batched"] == count["separate"]
    return {
        "rows": len(x),
        "nfe": count["batched"],
        "batched_s": t_batched,
        "separate_s": t_separate,
        "max_abs_diff": (batched - separate).abs().max().item(),
    }


def profile_iteration(preset: str, prompts: int, group: int, top: int = 25) -> None:
    """cProfile of one iteration (after a warm-up one): the functions with the most own time."""
    with tempfile.TemporaryDirectory() as tmp:
        s = build_session(small_config(preset, Path(tmp) / "run", prompts, group), resume=False)
        grpo_iteration(s, 0)
        prof = cProfile.Profile()
        prof.runcall(grpo_iteration, s, 1)
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)


def print_tables(rates: dict, costs: list[dict], lock: dict) -> None:
    peak_b = max(rates, key=lambda b: rates[b][0])
    print("\n### Rate of the built-in model (guided velocity, CFG counted twice), samples·forward/s\n")
    print("| batch (prompts per call) | built-in model | training policy (LoRA, unmerged) |\n|---|---|---|")
    for b, (base, lora) in rates.items():
        print(f"| {b} | {base:,.0f}{' (peak)' if b == peak_b else ''} | {lora:,.0f} |")
    print(f"\n### One iteration vs its NFE floor (peak {rates[peak_b][0]:,.0f}/s)\n")
    print(
        "| preset | NFE rollout / values / update | floor s | iteration s | ratio "
        "| rollout s | values s | reward s (overlapped) | update s |\n|---|---|---|---|---|---|---|---|---|"
    )
    for c in costs:
        nfe = c["nfe"]
        print(
            f"| {c['preset']} | {nfe['rollout']:,} / {nfe['values']:,} / {nfe['train']:,} | {c['floor']:.2f} "
            f"| {c['seconds']:.2f} | {c['ratio']:.2f}× | {c['rollout']:.2f} | {c['values']:.2f} "
            f"| {c.get('reward', 0.0):.2f} | {c['ppo_update']:.2f} |"
        )
    if lock is None:
        return
    print("\n### Value completions: batched lock-step vs one state at a time (same NFE)\n")
    print("| rows (states) | NFE | batched s | separate s | separate / batched | max abs diff |")
    speedup = lock["separate_s"] / lock["batched_s"]
    print(
        f"|---|---|---|---|---|---|\n| {lock['rows']} | {lock['nfe']:,} | {lock['batched_s']:.2f} "
        f"| {lock['separate_s']:.2f} | {speedup:.1f}× | {lock['max_abs_diff']:.1e} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", default=",".join(COMPARED_PRESETS))
    p.add_argument("--batch_sizes", default="8,16,32,64,128", help="prompts per velocity call")
    p.add_argument("--prompts", type=int, default=2, help="prompt groups per iteration")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--trajectories", type=int, default=16, help="rollouts in the lock-step comparison")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", default=None, metavar="PRESET", help="only profile one iteration of PRESET")
    p.add_argument("--demo_task", action="store_true", help="the demo task's recipe (window of 5 steps)")
    p.add_argument("--no_lockstep", action="store_true", help="skip lock-step vs separate completions")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile_iteration(args.profile, args.prompts, args.group)
        return
    t0 = time.perf_counter()
    rates = peak_rates([int(b) for b in args.batch_sizes.split(",")])
    peak = max(r[0] for r in rates.values())
    names = args.presets.split(",")
    costs = [iteration_cost(name, peak, args.prompts, args.group, demo=args.demo_task) for name in names]
    if "dense_grpo" in names:  # before/after the merged value completions, same run
        costs.append(iteration_cost("dense_grpo", peak, args.prompts, args.group, merged_values=False))
    lock = None if args.no_lockstep else lockstep_vs_separate(args.trajectories)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print_tables(rates, costs, lock)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
