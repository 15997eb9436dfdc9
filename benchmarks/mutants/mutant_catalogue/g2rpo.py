"""The mutants of G²RPO (issue 60): its completion grids and its multi-granularity integration."""

from __future__ import annotations

from .mutant import Mutant

GRANULAR = "flowcredit/granular.py"
TESTS = ("tests/test_g2rpo.py",)

MUTANTS = [
    Mutant(
        "g2rpo_integrates_the_first_width_only", "credit", GRANULAR,
        "return INTEGRATIONS[integration](z).clamp(-clip, clip)",
        "return z[..., 0].clamp(-clip, clip)",
        TESTS, "G²RPO's advantage is the fine completion's z-score alone: the coarser widths are ignored",
    ),
    Mutant(
        "g2rpo_grid_keeps_its_last_sigma", "plan", GRANULAR,
        "grid[-1] = 0.0",
        "grid[-1] = grid[-1]",
        TESTS, "G²RPO's coarse completion stops at its last subsampled σ instead of the clean prediction",
    ),
]  # fmt: skip
