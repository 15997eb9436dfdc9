"""The mutants of DGPO's update rule ``dgpo`` (issue 60): the sign of its group preference, and the noise
shared by a group's rows."""

from __future__ import annotations

from .mutant import Mutant

RULE = "flowcredit/update_dgpo.py"
LOOP = "flowcredit/run/forward_update.py"
TESTS = ("tests/test_update_dgpo.py",)

MUTANTS = [
    Mutant(
        "dgpo_group_weight_inverted", "update", RULE,
        "return torch.sigmoid(beta_dpo * sums / counts)[idx]",
        "return torch.sigmoid(-beta_dpo * sums / counts)[idx]",
        TESTS, "DGPO weighs a group by σ(−s_g), the gradient of another loss than its group DPO loss",
    ),
    Mutant(
        "dgpo_noise_per_row", "update", LOOP,
        "if not rule.group_noise:",
        "if True:",
        TESTS, "DGPO's group members are noised with a noise of their own instead of the group's",
    ),
]  # fmt: skip
