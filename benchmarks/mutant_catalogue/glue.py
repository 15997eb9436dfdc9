"""The mutants of issue 28: the training loop's glue (the update, the values, ψ, the KL term, EMA,
resume, export and the credit functions), the reward server, GenEval's rules, the composed LoRA and the
skill report."""

from __future__ import annotations

from .mutant import RESUME_TP, ROLLOUT, SESSION, TRAIN, Mutant

DIRECTION = "tests/test_direction.py"
VALUES = "tests/test_loop_values.py"
PSI = "tests/test_psi_run.py"

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
        "ema_never_updated", "ema", "flowcredit/run/micro_batches.py",
        "            s.ema.update()",
        "            pass",
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
    Mutant(
        "sampling_copy_without_lora", "lora", "flowcredit/run/lora_compose.py",
        "layer._sampling_weight = composed_weight(layer.base_layer.weight, a, b, layer.scaling[name])",
        "layer._sampling_weight = layer.base_layer.weight",
        ("tests/test_sampling_copies.py",), "the rollout's LoRA copy is the base weight (the LoRA ignored)",
    ),
    Mutant(
        "sampling_copy_stays", "lora", "flowcredit/run/lora_compose.py",
        "                del layer.forward  # peft's class forward again",
        "                pass",
        ("tests/test_sampling_copies.py",), "a layer keeps running its sampling copy after the rollout",
    ),
    Mutant(
        "split_uncond_with_grad", "lora", "flowcredit/models/protocol.py",
        "        with torch.no_grad():\n            v_uncond = uncond_only()",
        "        if True:\n            v_uncond = uncond_only()",
        ("tests/test_policy.py::test_cfg_uncond_grad_detaches_the_unconditional_branch",),
        "cfg_uncond_grad off: the separate unconditional pass keeps its graph (gradient through it)",
    ),
]  # fmt: skip
