"""The mutants of Flash-GRPO (issue 60): its rectification weight, its per-group step and the noise of its
per-group rollout."""

from __future__ import annotations

from .mutant import Mutant

WEIGHTS = "flowcredit/step_weights.py"
GROUPS = "flowcredit/run/group_plans.py"
TESTS = "tests/test_flash_grpo.py"

MUTANTS = [
    Mutant(
        "flash_weight_not_reciprocal", "weights", WEIGHTS,
        "return 1.0 / (root / g + g * root * (1.0 - sig[:-1]) / (2.0 * sig[:-1]))",
        "return root / g + g * root * (1.0 - sig[:-1]) / (2.0 * sig[:-1])",
        (TESTS,), "Flash-GRPO weights each step by the scale of ∂logp/∂v instead of its reciprocal",
    ),
    Mutant(
        "flash_step_not_the_groups", "plan", GROUPS,
        "return group_step[torch.arange(lo, hi) // (total // groups)]",
        "return group_step[torch.arange(lo, hi) % groups]",
        (TESTS,), "Flash-GRPO's rows take the steps of other groups, not their own group's",
    ),
    Mutant(
        "flash_runs_share_the_generator", "plan", GROUPS,
        "gen = torch.Generator().set_state(generator.get_state())  # each run: the noise of every row",
        "gen = generator",
        (TESTS,), "Flash-GRPO's runs draw their noise in turn: a row's noise depends on the split",
    ),
]  # fmt: skip
