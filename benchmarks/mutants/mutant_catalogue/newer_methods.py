"""The mutants of issue 39: the newer methods' loop glue (branch plans, step weights, RatioNorm,
forward-process updates, the old policy)."""

from __future__ import annotations

from .mutant import RESUME_TP, ROLLOUT, SESSION, TRAIN, Mutant

PLAN_TESTS = "tests/test_loop_plans.py"
UPDATE_TESTS = "tests/test_loop_updates.py"
PLANS = "flowcredit/run/plans.py"
FORWARD = "flowcredit/run/forward_update.py"
BRANCHES = f"{PLAN_TESTS}::test_branch_rollout_shares_the_ode_trunk_and_explores_one_step_per_branch"
WEIGHTED = f"{PLAN_TESTS}::test_update_gradient_is_the_weighted_sum_of_single_step_gradients"
RATIO = f"{UPDATE_TESTS}::test_ratio_norm_sees_the_rollouts_means_and_rescored_transitions"
FORWARD_GRAD = f"{UPDATE_TESTS}::test_forward_update_gradient_is_the_rules_loss_at_the_reproduced_draws"
OLD = f"{UPDATE_TESTS}::test_old_policy_is_soft_updated_after_the_iteration"
MIXGRPO = f"{PLAN_TESTS}::test_mixgrpo_iteration_explores_and_trains_the_window_of_its_iteration"

MUTANTS = [
    Mutant(
        "branch_sde_after_the_branch_step", "plans", PLANS,
        "one[0] = levels[k]", "one[:] = levels[k]",
        (BRANCHES,), "a branch keeps sampling with the SDE after its branch step (TempFlow, E-GRPO)",
    ),
    Mutant(
        "branch_from_the_previous_trunk_state", "plans", PLANS,
        "start = trunk[at_first, k]", "start = trunk[at_first, k - 1]",
        (BRANCHES,), "branch k starts from the trunk's x_{k-1} instead of x_k",
    ),
    Mutant(
        "branch_rows_step_major", "plans", PLANS,
        "return torch.stack(tensors, 1).reshape(-1, *tensors[0].shape[1:])",
        "return torch.stack(tensors, 0).reshape(-1, *tensors[0].shape[1:])",
        (BRANCHES,), "branch rows ordered (k, r), not (r, k): a rank's rows are no longer a slice",
    ),
    Mutant(
        "branch_normalised_over_all_branches", "plans", PLANS,
        "(group.view(-1, 1) * n_k + torch.arange(n_k)).reshape(-1),", "group.repeat_interleave(n_k),",
        (BRANCHES,), "a group's branches of every step share one normalisation group (no process reward)",
    ),
    Mutant(
        "branch_nfe_without_the_trunk", "plans", PLANS,
        "parts, nfe = [], len(first) * max(ks)", "parts, nfe = [], 0",
        (BRANCHES,), "the rollout's network calls leave out the ODE trunks",
    ),
    Mutant(
        "step_weight_not_applied", "loop", TRAIN,
        "s, plan, levels, sam, adv, prompts, cond, r, i, weight, float(weights[i]), uncond",
        "s, plan, levels, sam, adv, prompts, cond, r, i, weight, 1.0, uncond",
        (WEIGHTED,), "the per-step loss weight (TempFlow's std) never reaches the loss",
    ),
    Mutant(
        "step_weight_std_of_row_zero", "loop", TRAIN,
        "std = sam.ro.std.amax(dim=0)", "std = sam.ro.std[0]",
        (WEIGHTED,), "TempFlow's weights from one row's std (zero off its own branch step)",
    ),
    Mutant(
        "update_on_the_unmerged_grid", "loop", TRAIN,
        "sigma, sigma_next, level = plan.sigmas[i].item(), plan.sigmas[i + 1].item(), float(levels[i])",
        "sigma, sigma_next, level = s.sigmas[i].item(), s.sigmas[i + 1].item(), float(levels[i])",
        (WEIGHTED,), "E-GRPO's merged step is re-scored on the input grid's σ",
    ),
    Mutant(
        "ratio_norm_old_mean_is_the_new", "loop", TRAIN,
        '"mean_old": ro.means[r, i]', '"mean_old": step.mean.detach()',
        (RATIO,), "RatioNorm's old mean is the current policy's: its quadratic correction vanishes",
    ),
    Mutant(
        "rollout_keeps_the_next_state_as_mean", "loop", ROLLOUT,
        "means.append(step.mean.float())", "means.append(step.x_next.float())",
        (RATIO,), "the rollout stores x_next where GRPO-Guard needs the transition mean",
    ),
    Mutant(
        "forward_old_velocity_is_current", "update", FORWARD,
        "with torch.no_grad(), s.old.applied():", "with torch.no_grad():",
        (FORWARD_GRAD,), "AWM/NFT's v_old is the current policy's velocity, not the old policy's",
    ),
    Mutant(
        "forward_clean_is_the_initial_noise", "update", FORWARD,
        "clean = ro.states[:, -1]", "clean = ro.states[:, 0]",
        (FORWARD_GRAD,), "the forward process noises x_0 instead of the rollout's final sample",
    ),
    Mutant(
        "forward_noise_drawn_per_rank", "update", FORWARD,
        "noise = torch.randn((len(times), total, *clean.shape[1:]), generator=gen)[:, lo:hi]",
        "noise = torch.randn((len(times), hi - lo, *clean.shape[1:]), generator=gen)",
        (f"{UPDATE_TESTS}::test_forward_update_draws_of_a_row_do_not_depend_on_the_rank_split",),
        "a row's fresh noise depends on how the batch is split over ranks",
    ),
    Mutant(
        "old_decay_inverted", "update", FORWARD,
        's.old.decay = float(s.update.old_decay(s.history.get("update_steps", 0), **decay_opts))',
        's.old.decay = 1.0 - float(s.update.old_decay(s.history.get("update_steps", 0), **decay_opts))',
        (OLD,), "the old policy keeps (1 - η) of itself instead of η",
    ),
    Mutant(
        "old_decay_counts_one_iteration", "update", FORWARD,
        's.history["update_steps"] = s.history.get("update_steps", 0) + stats.updates',
        's.history["update_steps"] = stats.updates',
        (OLD,), "η ramps by this iteration's optimizer steps, not by all so far",
    ),
    Mutant(
        "old_policy_never_moves", "update", TRAIN,
        "    step_old_policy(s)", "    pass",
        (OLD,), "the old policy stays at the initial weights",
    ),
    Mutant(
        "nft_samples_with_the_current_policy", "update", TRAIN,
        'with clock("rollout"), s.sampling_policy():', 'with clock("rollout"):',
        (f"{UPDATE_TESTS}::test_diffusion_nft_rolls_out_with_the_old_policy",),
        "DiffusionNFT rolls out with θ instead of the old policy",
    ),
    Mutant(
        "mixgrpo_levels_of_the_fixed_window", "loop", TRAIN,
        "levels = levels_of(plan, cfg, s.psi)", "levels = s.levels",
        (MIXGRPO,), "the rollout samples with the fixed window's levels, not the plan's (MixGRPO)",
    ),
    Mutant(
        "plan_of_iteration_zero", "loop", TRAIN,
        "plan = iteration_plan(cfg, s.sigmas, it)", "plan = iteration_plan(cfg, s.sigmas, 0)",
        (MIXGRPO,), "every iteration follows iteration 0's plan (MixGRPO's window never slides)",
    ),
    Mutant(
        "old_policy_not_checkpointed", "resume", SESSION,
        "            old=old,", "            old=None,",
        (f"{RESUME_TP}[awm-before_cleanup]",), "a resumed AWM run restarts its old policy from θ_0",
    ),
]  # fmt: skip
