"""The mutants of issue 54: five behaviours an outside mutation check found the whole suite let through
(TP-GRPO's turning points after a zero gain and its trend in a late window, ψ calibration at its floor,
draws that change with the iteration, ``--guidance_scale 1``)."""

from __future__ import annotations

from .mutant import ROLLOUT, Mutant

ADV_TESTS = "tests/test_advantages.py"
ZERO_GAIN = f"{ADV_TESTS}::test_a_zero_gain_before_a_with_trend_gain_is_no_turning_point"
LATE_WINDOW = f"{ADV_TESTS}::test_the_trend_is_measured_from_the_windows_start"

MUTANTS = [
    Mutant(
        "tp_zero_gain_counts_as_against", "credit", "flowcredit/advantages.py",
        "tp[:, i] = (s[:, i - 1] < 0) & (s[:, i] > 0)", "tp[:, i] = (s[:, i - 1] <= 0) & (s[:, i] > 0)",
        (ZERO_GAIN, f"{ADV_TESTS}::test_a_zero_gain_keeps_its_successors_step_reward"),
        "TP-GRPO: a step after a zero gain counts as a turning point (zero taken as against the trend)",
    ),
    Mutant(
        "tp_trend_from_state_zero", "credit", "flowcredit/advantages.py",
        "trend = torch.sign(final[:, 0] - v[:, w])", "trend = torch.sign(final[:, 0] - v[:, 0])",
        (LATE_WINDOW, f"{ADV_TESTS}::test_a_late_window_turning_point_gets_its_aggregated_reward"),
        "TP-GRPO's trend is V_N − V_0, not V_N − V_w from the SDE window's start",
    ),
    Mutant(
        "psi_floor_is_no_change", "psi", "flowcredit/calibration.py",
        "flip = (direction * last_dir < 0) | ((direction == 0) & (last_dir < 0))",
        "flip = direction * last_dir < 0",
        ("tests/test_calibration.py",),
        "ψ clamped at the floor ε₂ after a decrease is no change of direction: calibration runs to its cap",
    ),
    Mutant(
        "draws_ignore_the_iteration", "loop", ROLLOUT,
        "manual_seed(seed * 1_000_003 + iteration * 101 + purpose)",
        "manual_seed(seed * 1_000_003 + purpose)",
        ("tests/test_iteration_draws.py",),
        "every iteration draws the same prompts, initial noise, SDE noise and update order",
    ),
    Mutant(
        "guidance_one_is_the_default", "loop", "flowcredit/models/registry.py",
        "if cfg.guidance_scale > 0:", "if cfg.guidance_scale > 1:",
        ("tests/test_guidance_flag.py",),
        "--guidance_scale 1 (CFG off) is replaced by the model's default guidance",
    ),
]  # fmt: skip
