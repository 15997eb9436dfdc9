"""What ``flowcredit bench`` compares: its tasks (``--task``: the settings every cell shares), its
ablations per preset (``--ablations``) and the one-step-value rows beside the dense presets
(:data:`CHEAP`). Re-exported by :mod:`flowcredit.commands.bench`.
"""

from __future__ import annotations

from flowcredit.commands.bench_skill import SKILL_ARMS
from flowcredit.config import Config, trained_window
from flowcredit.presets import demo

QUICK = (
    "--iterations 2 --prompts_per_iter 2 --group_size 4 --num_steps 5 --window_size 0 "
    "--num_eval_prompts 2 --eval_samples_per_prompt 2 --eval_every 1 --calib_max_iters 1 --calib_groups 1 "
    "--batch_size 16"
).split()
"""``--quick``: a few-minute smoke run (window_size 0 = every trainable step of the 5)."""


DEMO_RECIPE = (
    *("train_prompts", "prompts_per_iter", "group_size", "window_size", "steps_per_update", "lr"),
    *("num_eval_prompts", "eval_samples_per_prompt", "iterations"),
)
"""The fields of the ``demo`` preset that make up the recipe (not its sampler, noise or credit)."""


def _demo_task() -> list[str]:
    """The ``demo`` preset's recipe as overrides, plus the bench's budget and evaluation settings."""
    recipe = demo()
    task = [s for name in DEMO_RECIPE for s in (f"--{name}", str(getattr(recipe, name)))]
    return task + ["--max_minutes", "0", "--calib_max_iters", "4", "--calib_groups", "2", "--eval_every", "2"]


def _compare_task() -> list[str]:
    """The demo recipe, evaluated on every held-out prompt (86 × 4 samples) and calibrating ψ fully."""
    pairs = dict(zip(_demo_task()[::2], _demo_task()[1::2]))
    pairs = {k: v for k, v in pairs.items() if k not in ("--calib_max_iters", "--calib_groups")}
    pairs |= {"--num_eval_prompts": "0", "--eval_samples_per_prompt": "4"}
    return [s for pair in pairs.items() for s in pair]


TASKS = {
    "demo": _demo_task,
    "compare": _compare_task,
    "presets": lambda: ["--iterations", "40", "--eval_every", "5"],
    "skill": lambda: [],
}
"""``--task``: ``demo`` = the demo recipe (docs/recipes.md: 4 counting prompts × 12, LoRA r 4, lr 3e-4,
an SDE window of 5 steps) with each method's own sampler, noise and credit, 10 iterations, evaluated every
2 on 16 held-out prompts × 8; ``compare`` = the same on all 86 held-out prompts × 4, with ψ calibrated by
the config's own rule (the powered comparison, docs/benchmarks.md); ``presets`` = the presets' own
settings (the whole train set, 4 groups × 16), 40 iterations; ``skill`` = the presets' own settings
(use it with ``--presets skill`` and its arms, ``--ablations tp,…``: :mod:`bench_skill`), each finished
run then evaluated on the held-out prompts with noise seeds no choice has seen."""


def _half_window(cfg: Config) -> list[str]:
    return ["--window_size", str(max(1, trained_window(cfg)[1] // 2))]


SHARED = {
    "beta": ["--beta", "0.04", "--kl_mode", "flow_grpo"],
    "accum": ["--steps_per_update", "5"],
}
"""Candidates for settings shared by every method: Flow-GRPO's KL (β 0.04 with its own normaliser), and
its optimizer geometry (every window step of the demo task accumulated into one optimizer step)."""

ABLATIONS = {
    "flow_grpo": SHARED,
    "tp_grpo": {
        **SHARED,
        "no_constraint": ["--tp_constrained", "false"],
        "no_first_step": ["--tp_first_step", "false"],
        "no_balance": ["--tp_balance", "none"],
        "half_window": _half_window,
    },
    "skill": SKILL_ARMS,
    "stepwise_grpo": {
        "per_step_norm": ["--credit", "dense", "--credit_options", ""],
        "centred": ["--credit_options", '{"center": true}'],
        "shared_noise": ["--shared_noise", "true"],
    },
    "dense_grpo": {
        "uniform_noise": ["--calibrate", "false"],
        "euler5": ["--estimator", "euler", "--substeps", "5"],
    },
}
"""``--ablations``: variants of each selected preset (ode_remaining is dense_grpo's own estimator)."""

EULER1 = ["--estimator", "euler", "--substeps", "1"]
CHEAP = {"dense_grpo": {"euler1": EULER1}, "tp_grpo": {"euler1": EULER1}}
"""Rows of the comparison beside their presets: the dense methods with one-step (Tweedie, ``euler`` k = 1)
values instead of ODE completions, at about Flow-GRPO's cost per iteration (``--no_cheap`` drops them)."""
