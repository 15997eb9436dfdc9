"""The mutants of ``benchmarks/mutants.py`` (issue 28): each one semantic bug, written as an exact edit of
one line of ``flowcredit/``, with the tests that should catch it. The runner lives in ``mutants.py``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # loop, values, psi, kl, ema, resume, export, credit
    path: str  # file under the repository root
    old: str  # exact text, present once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that should fail
    bug: str  # the bug in words


DIRECTION = "tests/test_direction.py"
VALUES = "tests/test_loop_values.py"
PSI = "tests/test_psi_run.py"
RESUME_TP = "tests/test_resume.py::test_killed_in_a_checkpoint_write_resumes_exactly"
TRAIN = "flowcredit/train.py"
ROLLOUT = "flowcredit/run/rollout.py"
SESSION = "flowcredit/run/session.py"

MUTANTS = [
    Mutant(
        "adv_sign_in_update", "loop", TRAIN,
        '"logp_old": logp_old, "adv": adv[r, i]}',
        '"logp_old": logp_old, "adv": -adv[r, i]}',
        (DIRECTION,), "the update learns to lower the reward (advantage sign flipped)",
    ),
    Mutant(
        "completion_with_other_rows_prompt", "values", ROLLOUT,
        "chunked_velocity(model, x, sigma, cond, group[row_of[live]], batch_size)",
        "chunked_velocity(model, x, sigma, cond, group[live], batch_size)",
        (VALUES,), "a state is completed with another row's prompt",
    ),
    Mutant(
        "update_with_other_rows_prompt", "loop", TRAIN,
        "model.velocity(x, plan.sigmas[i].expand(len(r)), cond[group[r]])",
        "model.velocity(x, plan.sigmas[i].expand(len(r)), cond[group[r].flip(0)])",
        (DIRECTION,), "the update re-scores a transition under another row's prompt",
    ),
    Mutant(
        "update_at_previous_level", "loop", TRAIN,
        "sigma, sigma_next, level = plan.sigmas[i].item(), plan.sigmas[i + 1].item(), float(levels[i])",
        "sigma, sigma_next, level = plan.sigmas[i].item(), plan.sigmas[i + 1].item(), float(levels[i - 1])",
        (DIRECTION,), "the update scores step i with the noise level of step i - 1",
    ),
    Mutant(
        "advantages_one_group", "loop", TRAIN,
        "s.credit.fn(values_all[ok], group_all[ok], trained, **s.credit_kwargs)",
        "s.credit.fn(values_all[ok], torch.zeros_like(group_all[ok]), trained, **s.credit_kwargs)",
        (DIRECTION,), "the loop normalises advantages over the batch, not per group",
    ),
    Mutant(
        "update_keeps_dead_groups", "loop", TRAIN,
        "keep = torch.nonzero(torch.isin(sam.norm_group, live_groups), as_tuple=True)[0]",
        "keep = torch.nonzero(~torch.isin(sam.norm_group, live_groups), as_tuple=True)[0]",
        (DIRECTION,), "the update trains the zero-advantage groups and drops the live ones",
    ),
    Mutant(
        "kl_sign", "kl", TRAIN,
        "s.dist.backward((w_i * policy_loss + cfg.beta * kl) * weight)",
        "s.dist.backward((w_i * policy_loss - cfg.beta * kl) * weight)",
        (f"{DIRECTION}::test_the_kl_term_pulls_the_policy_to_the_reference",),
        "the KL term pushes the policy away from the reference",
    ),
    Mutant(
        "kl_reference_is_the_policy", "kl", TRAIN,
        "with torch.no_grad(), s.policy.reference():",
        "with torch.no_grad():",
        (f"{DIRECTION}::test_the_kl_term_pulls_the_policy_to_the_reference",),
        "the KL's reference forward runs the current policy (KL always 0)",
    ),
    Mutant(
        "values_off_by_one_state", "values", "flowcredit/values.py",
        "idx = (start[:, None] + torch.arange(n + 1, device=start.device)[None, :]).clamp(max=n)",
        "idx = (start[:, None] + 1 + torch.arange(n + 1, device=start.device)[None, :]).clamp(max=n)",
        (VALUES,), "ode_remaining completes along the schedule one σ late",
    ),
    Mutant(
        "euler_one_substep_short", "values", "flowcredit/values.py",
        "return grid, torch.where(start < n, substeps, 0)",
        "return grid, torch.where(start < n, substeps - 1, 0)",
        (VALUES,), "euler(k) stops one sub-step before σ = 0",
    ),
    Mutant(
        "copy_through_ode_steps_for_euler", "values", ROLLOUT,
        "by_step = deterministic if ESTIMATORS[estimator].follows_schedule else tail",
        "by_step = deterministic",
        ("tests/test_rollout.py",), "euler values copied across a deterministic step they do not follow",
    ),
    Mutant(
        "psi_start_level", "psi", "flowcredit/run/calibrate.py",
        "def start_psi(sigmas: torch.Tensor, trained: torch.Tensor, a: float = 0.7)",
        "def start_psi(sigmas: torch.Tensor, trained: torch.Tensor, a: float = 0.5)",
        (PSI,), "ψ starts at Flow-SDE's g with a = 0.5 instead of 0.7",
    ),
    Mutant(
        "psi_not_the_rollout_noise", "psi", ROLLOUT,
        "        levels = torch.where(trained, psi, torch.zeros_like(psi))",
        "        levels = levels",
        (PSI,), "the rollout samples with noise_level, not the calibrated ψ",
    ),
    Mutant(
        "psi_path_ignored", "psi", SESSION,
        "    elif cfg.psi_path:",
        "    elif False:",
        (PSI,), "psi_path is read by validation but never used",
    ),
    Mutant(
        "psi_lost_on_resume", "psi", SESSION,
        'self.psi = torch.tensor(extra["psi"]) if extra.get("psi") is not None else None',
        "self.psi = None",
        (f"{PSI}::test_psi_after_resume_is_the_calibrated_one",), "a resumed DenseGRPO run recalibrates ψ",
    ),
    Mutant(
        "ema_weights_swapped", "ema", "flowcredit/run/policy.py",
        "s.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)",
        "s.mul_(1.0 - self.decay).add_(p.detach(), alpha=self.decay)",
        ("tests/test_policy.py::test_ema_tracks_and_applies",),
        "EMA keeps (1 - d) of the average instead of d",
    ),
    Mutant(
        "ema_never_updated", "ema", TRAIN,
        "                s.ema.update()",
        "                pass",
        (f"{DIRECTION}::test_ema_averages_the_weights_after_every_optimizer_step",),
        "the loop never updates the EMA",
    ),
    Mutant(
        "ema_not_restored", "resume", SESSION,
        'for kept, saved in ((self.ema, state["ema"]), (self.old, state.get("old"))):',
        'for kept, saved in ((self.old, state.get("old")),):',
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "a resumed run restarts its EMA from the weights",
    ),
    Mutant(
        "optimizer_not_restored", "resume", SESSION,
        "        self.optimizer.load_state_dict(optimizer)",
        "        pass",
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "a resumed run restarts AdamW's moments",
    ),
    Mutant(
        "resume_skips_an_iteration", "resume", SESSION,
        'self.start_iteration = state["iteration"]',
        'self.start_iteration = state["iteration"] + 1',
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "resume starts one iteration late",
    ),
    Mutant(
        "old_checkpoint_not_found", "resume", "flowcredit/run/checkpoint.py",
        'for name in ("checkpoint", "checkpoint.old"):',
        'for name in ("checkpoint",):',
        (f"{RESUME_TP}[tp_grpo-between_renames]",), "a kill between the renames leaves no resumable run",
    ),
    Mutant(
        "checkpoint_deleted_before_swap", "resume", "flowcredit/run/checkpoint.py",
        "        os.replace(final, previous)",
        "        shutil.rmtree(final)",
        (f"{RESUME_TP}[tp_grpo-between_renames]",), "the old checkpoint is deleted before the new one is in",
    ),
    Mutant(
        "export_without_ema", "export", "flowcredit/run/outputs.py",
        "with s.ema.applied() if s.ema is not None else contextlib.nullcontext(), s.dist.unsharded(s.model):",
        "with contextlib.nullcontext(), s.dist.unsharded(s.model):",
        ("tests/test_train.py::test_final_export_holds_the_ema_weights",),
        "final/ holds the last iterate, not the EMA",
    ),
    Mutant(
        "export_unmerged_lora", "export", "flowcredit/run/policy.py",
        "                module.merge()\n        out = {}",
        "                pass\n        out = {}",
        ("tests/test_train.py::test_final_model_reloads_as_the_policy",), "the exported model drops the LoRA",
    ),
    Mutant(
        "flow_grpo_not_centred", "credit", "flowcredit/advantages.py",
        "centred = torch.where(ms, xs - mean, torch.zeros_like(xs))",
        "centred = torch.where(ms, xs, torch.zeros_like(xs))",
        ("tests/test_advantages.py",), "group z-scores without the group mean",
    ),
    Mutant(
        "tp_aggregate_sign", "credit", "flowcredit/advantages.py",
        "agg = v[:, -1:] - v[:, :-1]  # (B, N): V_N − V_i",
        "agg = v[:, :-1] - v[:, -1:]  # (B, N): V_N − V_i",
        ("tests/test_advantages.py",), "turning points get V_i - V_N instead of V_N - V_i",
    ),
    Mutant(
        "surrogate_min_not_max", "credit", "flowcredit/losses.py",
        "return torch.maximum(unclipped, clipped).mean()",
        "return torch.minimum(unclipped, clipped).mean()",
        ("tests/test_losses.py",), "PPO's pessimistic bound taken the wrong way",
    ),
    Mutant(
        "dtype_from_first_parameter", "export", "flowcredit/models/diffusers_common.py",
        'if p.is_floating_point() and "lora_" not in name and not any(k in name for k in keep):',
        'if p.is_floating_point():',
        ("tests/test_adapters_dtypes.py",), "Wan in bf16 takes float32 from a kept-in-fp32 norm and crashes",
    ),
    Mutant(
        "cli_samples_the_base", "export", "flowcredit/commands/eval.py",
        "        model.load_trained(final)",
        "        pass",
        ("tests/test_trained_cli.py",), "sample/eval --checkpoint RUN/final quietly use the base weights",
    ),
    Mutant(
        "failed_start_leaves_config", "resume", SESSION,
        '            (run_dir / "config.json").unlink(missing_ok=True)',
        "            pass",
        ("tests/test_trained_cli.py",), "a failed start leaves run_dir/config.json behind",
    ),
    Mutant(
        "slot_before_body", "server", "flowcredit/rewards/app.py",
        "            async with service.bodies.account() as account:",
        "            async with service.bodies.account() as account, service.slots:",
        ("tests/test_reward_server_hostile.py::test_slow_uploads_do_not_block_other_clients",),
        "a request takes a scoring slot before its body arrives: slow uploads block everyone",
    ),
    Mutant(
        "fifo_batching", "server", "flowcredit/rewards/batcher.py",
        "        self._fair_order()\n",
        "",
        ("tests/test_reward_server_hostile.py::test_a_small_request_is_not_stuck_behind_a_large_one",),
        "a small request waits behind every call of a large one",
    ),
    Mutant(
        "no_request_head_deadline", "server", "flowcredit/rewards/server.py",
        "        http=guarded_protocol(limits, Admission(limits)),",
        '        http="httptools",',
        ("tests/test_reward_server_hostile.py::test_idle_and_half_open_connections_are_closed",),
        "idle and half-open connections stay open until they fill max_connections",
    ),
    Mutant(
        "no_suspects", "server", "flowcredit/rewards/batcher.py",
        "                self._mark(batch[0].pending, failed=True)",
        "                pass",
        ("tests/test_reward_server_hostile.py::test_a_failing_client_does_not_poison_later_batches",),
        "a failing client's every request joins and fails a merged call",
    ),
    Mutant(
        "bisect_one_by_one", "server", "flowcredit/rewards/batcher.py",
        "            half = set(requests[: len(requests) // 2])",
        "            half = set(requests[:1])",
        ("tests/test_reward_server_hostile.py::test_one_bad_request_costs_log_n_extra_reward_calls",),
        "a failing merged call is split one request at a time (n extra calls)",
    ),
    Mutant(
        "geneval_margin_sign", "geneval", "flowcredit/tasks/geneval/rules.py",
        "shrunk = np.maximum(np.abs(offset) - margin * (size[0] + size[1]), 0) * np.sign(offset)",
        "shrunk = np.maximum(np.abs(offset) + margin * (size[0] + size[1]), 0) * np.sign(offset)",
        ("tests/test_geneval_rules.py",), "position margin grows the offset instead of shrinking it",
    ),
    Mutant(
        "geneval_counting_threshold", "geneval", "flowcredit/tasks/geneval/rules.py",
        'threshold = settings.counting_threshold if tag == "counting" else settings.threshold',
        "threshold = settings.threshold",
        ("tests/test_geneval_rules.py",), "counting prompts use 0.3 instead of GenEval's 0.9",
    ),
    Mutant(
        "geneval_exclude_off_by_one", "geneval", "flowcredit/tasks/geneval/rules.py",
        'float(n < int(req["count"]))', 'float(n <= int(req["count"]))',
        ("tests/test_geneval_rules.py",), "an exclude fails at count − 1 objects",
    ),
    Mutant(
        "geneval_failed_target", "geneval", "flowcredit/tasks/geneval/rules.py",
        "groups.append(group if ok else None)", "groups.append(group)",
        ("tests/test_geneval_rules.py",), "a target group that failed its own rules still anchors a position",
    ),
    Mutant(
        "lora_compose_scale", "lora", "flowcredit/run/lora_compose.py",
        "return weight + (scale * delta).to(weight.dtype)", "return weight + delta.to(weight.dtype)",
        ("tests/test_lora_compose.py",), "the composed LoRA forgets its scale alpha / r",
    ),
    Mutant(
        "one_step_sign", "values", "flowcredit/run/rollout.py",
        "return x - sigma.to(x).view(-1, *([1] * (x.dim() - 1))) * v",
        "return x + sigma.to(x).view(-1, *([1] * (x.dim() - 1))) * v",
        ("tests/test_rollout.py::test_one_step_values_reuse_the_rollout_velocity",),
        "one-step values from the rollout's velocity step the wrong way",
    ),
    Mutant(
        "skill_paired_sign", "bench", "flowcredit/commands/bench_skill_report.py",
        "values = [by_seed[s][key][part] - arms[baseline][s][key][part] for s in seeds]",
        "values = [arms[baseline][s][key][part] - by_seed[s][key][part] for s in seeds]",
        ("tests/test_bench_skill.py",), "the skill report's paired difference has its sign flipped",
    ),
    Mutant(
        "skill_nfe_no_kl", "bench", "flowcredit/commands/bench_skill.py",
        "update = trained * cfg.inner_epochs * (2 if cfg.beta else 1)",
        "update = trained * cfg.inner_epochs",
        ("tests/test_bench_skill.py",), "equal-NFE iterations forget the KL's reference forward",
    ),
]  # fmt: skip

# --- the newer methods' loop glue (issue 39): branch plans, step weights, RatioNorm, forward-process updates
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

MUTANTS += [
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
        "out = step_loss(s, plan, levels, sam, adv, prompts, cond, r, i, weight, float(weights[i]))",
        "out = step_loss(s, plan, levels, sam, adv, prompts, cond, r, i, weight, 1.0)",
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
        's.history["update_steps"] = s.history.get("update_steps", 0) + updates',
        's.history["update_steps"] = updates',
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
