"""The credit audit's cost on this machine (issue 55: the full built-in-model audit, 86 prompts × 12,
in ≤ 2 h on 2 cores; the quick one, 16 prompts, in ≤ 15 min).

Audits ``--prompts`` held-out prompts one group at a time exactly as ``flowcredit audit`` does (the
``skill`` preset's sampler, ``M`` completions per state, every rule), times each group, and prints
seconds per group and the projected quick and full audits, with and without the gradient cosines.
Take figures from a quiet machine (the skill grid paused):

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/speed/audit_rate.py --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from flowcredit.models import load_model
from flowcredit.presets import load_config
from flowcredit.run.audit import audit_group, audit_rules
from flowcredit.run.session import build_reward, configure_network
from flowcredit.tasks.prompt_sets import load_prompt_set


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=2, help="groups timed (each once)")
    p.add_argument("--m", type=int, default=32)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config("skill")
    model = load_model(cfg)
    configure_network(cfg, model)
    reward, rules = build_reward(cfg, cfg.reward), audit_rules()
    metas = load_prompt_set("test", args.prompts, spread=True)
    plain, with_grads = [], []
    for k, meta in enumerate(metas):
        for grads, times in ((False, plain), (True, with_grads)):
            t0 = time.perf_counter()
            audit_group(model, cfg, reward, [meta], rules, args.m, None, 0, k, grads)
            times.append(time.perf_counter() - t0)
    per, per_grads = sum(plain) / len(plain), sum(with_grads) / len(with_grads)
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"
    )
    print(f"{cpu}, {args.threads} threads, torch {torch.__version__}; M = {args.m}, group {cfg.group_size}")
    print(f"seconds per prompt group: {per:.1f} (with gradient cosines {per_grads:.1f})")
    for name, n in (
        ("quick (16 prompts, 4 with gradients)", 16),
        ("full (86 prompts, 4 with gradients)", 86),
    ):
        print(f"{name}: {((n - 4) * per + 4 * per_grads) / 60:.1f} min")


if __name__ == "__main__":
    main()
