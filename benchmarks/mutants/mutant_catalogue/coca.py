"""The mutants of CoCA's credit rule ``coca`` (issue 60): its shares and the plumbing that hands it the
similarities of the rollout's clean predictions at no extra network call."""

from __future__ import annotations

from .mutant import ROLLOUT, TRAIN, Mutant

TESTS = "tests/test_credit_coca.py"

MUTANTS = [
    Mutant(
        "coca_share_counts_the_past", "credit", "flowcredit/contribution.py",
        "return shares.flip(1).cumsum(1).flip(1)", "return shares.cumsum(1)",
        (TESTS,), "CoCA credits each step with the share of the gain made up to it instead of from it on",
    ),
    Mutant(
        "coca_similarity_of_the_state", "values", ROLLOUT,
        "clean = one_step_clean(x, v, sigma).view(b, n, *x.shape[1:])  # (B, N, …)",
        "clean = x.view(b, n, *x.shape[1:])  # (B, N, …)",
        (TESTS,), "CoCA's similarities use the noisy state x_i instead of its clean prediction x_i − σ_i·v_i",
    ),
    Mutant(
        "coca_velocities_not_kept", "values", TRAIN,
        "opts = s.rollout_opts | rollout_keeps(s.credit.needs)", "opts = s.rollout_opts",
        (TESTS,), "CoCA's rollout drops its velocities, so its similarities cost a network call per state",
    ),
]  # fmt: skip
