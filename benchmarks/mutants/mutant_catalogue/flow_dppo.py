"""The mutants of Flow-DPPO's update rule ``dppo`` (issue 60): its trust region and its asymmetric mask."""

from __future__ import annotations

from .mutant import Mutant

RULES = "flowcredit/update_rules.py"
TESTS = "tests/test_update_dppo.py"

MUTANTS = [
    Mutant(
        "dppo_masks_the_corrective_rows", "update", RULES,
        "return far & (((r > 1.0) & (a > 0)) | ((r < 1.0) & (a < 0)))",
        "return far & (((r < 1.0) & (a > 0)) | ((r > 1.0) & (a < 0)))",
        (TESTS,), "Flow-DPPO drops the rows moving back toward the old policy instead of those moving away",
    ),
    Mutant(
        "dppo_region_inverted", "update", RULES,
        "far = d >= kl_mask_threshold", "far = d < kl_mask_threshold",
        (TESTS,), "Flow-DPPO's mask applies inside the trust region instead of outside it",
    ),
]  # fmt: skip
