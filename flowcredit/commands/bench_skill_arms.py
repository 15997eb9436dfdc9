"""The skill comparison's arms (:data:`SKILL_ARMS`: the ``skill`` preset with one change each) and its
compute accounting: the network calls of an iteration as the trainer logs them (:func:`nfe_parts`),
and the iterations that give an arm the preset's calls (:func:`_equal_nfe`). Re-exported by
:mod:`flowcredit.commands.bench_skill`.
"""

from __future__ import annotations

import dataclasses

from flowcredit.config import Config


def nominal_nfe(cfg: Config) -> float:
    """Network calls per trajectory and iteration: rollout + value completions + update (KL: ×2).

    The count the trainer logs as ``nfe/*`` divided by the batch rows, with every group live; the
    value completions are planned exactly as :func:`flowcredit.run.rollout.state_values` plans them.
    """
    return float(sum(nfe_parts(cfg).values()))


def nfe_parts(cfg: Config) -> dict[str, float]:
    """:func:`nominal_nfe`'s terms: ``{"rollout", "values", "update"}`` network calls per trajectory,
    averaged over the run's iterations where the step schedule changes the plan (a branch plan's
    rollout: its trunk, once per group, and every branch, :func:`flowcredit.run.plans.branch_sample`;
    a forward-process update: K time draws × the current and the old policy, and the reference)."""
    import torch

    from flowcredit.advantages import CREDITS
    from flowcredit.run.plans import iteration_plan
    from flowcredit.run.rollout import needed_states, plan_completions
    from flowcredit.schedule import sigmas
    from flowcredit.updates import UPDATES
    from flowcredit.validation import update_options
    from flowcredit.values import ESTIMATORS

    grid = sigmas(cfg.num_steps, cfg.shift)
    plans = [iteration_plan(cfg, grid, it) for it in range(max(cfg.iterations, 1))]
    first = plans[0]
    need = needed_states(CREDITS[cfg.credit].needs, first.trained)  # (M + 1,)
    compute, _ = plan_completions(need, ~first.sde, cfg.estimator)
    start = torch.nonzero(compute, as_tuple=True)[0]
    values = 0
    if len(start) and not (cfg.estimator == "euler" and cfg.substeps == 1):  # one-step: the rollout's v
        _, remaining = ESTIMATORS[cfg.estimator].grid(first.sigmas, start, cfg.substeps)
        values = int(remaining.sum())
    rollout = sum(rollout_calls(p, cfg.group_size) for p in plans) / len(plans)
    rule = UPDATES[cfg.update]
    if rule.forward:
        draws = rule.times(
            grid, 1, torch.Generator().manual_seed(0), **rule.split(update_options(cfg))[1]
        ).shape[0]
        update = draws * cfg.inner_epochs * rule.calls(cfg.beta)
    else:
        trained = sum(trained_per_row(p) for p in plans) / len(plans)
        update = trained * cfg.inner_epochs * (2 if cfg.beta else 1)
    return {"rollout": rollout, "values": values, "update": update}


def trained_per_row(plan) -> float:
    """Steps one trajectory trains: the plan's trained steps; a per-group plan's (Flash-GRPO) one step; a
    tree's transitions over its leaves (each trained once: TreeGRPO's ``Σ_j k^{j+1} / k^d``)."""
    if plan.tree is not None:  # a transition into depth m is trained once per node of depth m
        from flowcredit.tree_plans import step_depths

        depths = step_depths(plan.tree.splits, plan.sde.numel())[plan.sde]
        return float(sum(plan.tree.fanout ** int(m) for m in depths)) / plan.tree.leaves
    return 1 if plan.group_step is not None else int(plan.trained.sum())


def rollout_calls(plan, group_size: int) -> float:
    """Network calls per trajectory of one plan's rollout: its ``M`` steps; a branch plan's trunk
    (``k_max`` steps once per group) and each branch ``k`` (``M − k`` steps per row; G²RPO's coarse
    completions on top, :func:`flowcredit.granular.granular_calls`)."""
    m = plan.sde.numel()
    if plan.tree is not None:
        from flowcredit.tree_plans import tree_calls

        return tree_calls(plan, group_size)
    if not plan.branch:
        return float(m)
    ks = plan.sde.nonzero()[:, 0].tolist()
    extra = 0
    if plan.granular is not None:  # G²RPO's coarse completions of every branch
        from flowcredit.granular import granular_calls

        extra = granular_calls(plan.sigmas, ks, plan.granular.widths)
    return max(ks) / group_size + sum(m - k for k in ks) + extra


def nominal_calls(cfg: Config) -> float:
    """:func:`nominal_nfe`'s terms × network passes per velocity call on the built-in model (2 with CFG,
    1 at guidance 1: no CFG), the skill bench's model; the update's at ``train_guidance_scale``."""
    passes = 1 if cfg.guidance_scale == 1.0 else 2
    train_passes = 1 if (cfg.train_guidance_scale or cfg.guidance_scale) == 1.0 else 2
    parts = nfe_parts(cfg)
    return (parts["rollout"] + parts["values"]) * passes + parts["update"] * train_passes


def _equal_nfe(preset: Config, change: list[str], share: float = 1.0) -> list[str]:
    """``change`` plus the iterations at which its network calls are ``share`` × the preset's (a fixed
    point: an arm whose plan changes with the iteration averages its cost over its own iterations); the
    calls of an iteration count every row (prompts × group)."""
    from flowcredit.validation import apply_overrides

    def per_iteration(cfg: Config) -> float:  # an arm may change the group (TreeGRPO's 27 leaves)
        return nominal_calls(cfg) * cfg.prompts_per_iter * cfg.group_size

    budget, iterations = share * preset.iterations * per_iteration(preset), preset.iterations
    for _ in range(5):
        arm = apply_overrides(dataclasses.replace(preset), [*change, "--iterations", str(iterations)])
        iterations, previous = round(budget / per_iteration(arm)), iterations
        if iterations == previous:
            break
    return [*change, "--iterations", str(iterations)]


TP = ["--credit", "turning_point"]
DENSE = ["--credit", "dense", "--sampler", "dance_sde", "--calibrate", "true"]
STEPWISE = ["--credit", "stepwise", "--credit_options", '{"center": false}', "--estimator", "euler"]
MIXGRPO = [
    "--step_schedule",
    "mixgrpo",
    "--step_schedule_options",
    '{"size": 2, "interval": 25, "skip_last": 5}',
]
TEMPFLOW = [
    "--step_schedule",
    "tempflow",
    "--step_schedule_options",
    '{"skip_last": 5}',
    "--step_weight",
    "tempflow",
]
EGRPO = ["--step_schedule", "egrpo"]
GUARD = ["--update", "ratio_norm", "--step_weight", "grpo_guard"]
SHARED = ["--shared_noise", "true"]  # branches share the prefix of their group
NO_CFG = [
    "--guidance_scale",
    "1",
    "--eval_guidance_scale",
    "2",
]  # rollouts without CFG, evaluated as all arms
NFT = ["--update", "nft", "--sampler", "ode", "--steps_per_update", "9", *NO_CFG]
AWM = ["--update", "awm", "--sampler", "flow_sde", "--noise_level", "0.57", "--window_size", "7"]
AWM += ["--steps_per_update", "6", *NO_CFG]
COCA = ["--credit", "coca"]
FLASH = ["--step_schedule", "flash", "--step_weight", "flash"]
FLASH += ["--sampler", "flash_sde", "--noise_level", "0.9"]  # Flash-GRPO's SDE at σ_1 of the 10-step grid
TREE = ["--step_schedule", "treegrpo", "--step_schedule_options", '{"skip_last": 5}', "--group_size", "27"]
BRANCH = [  # the splits' noise as the steps' own: 4 × CPS's noise would break its coefficient preservation
    *["--step_schedule", "branchgrpo", "--step_schedule_options", '{"skip_last": 5, "split_noise": 1}']
]
BRANCH += ["--group_size", "16"]
DGPO = [  # ODE rollouts with CFG and the update on the conditional velocity, as its code
    *["--update", "dgpo", "--sampler", "ode", "--steps_per_update", "4", "--train_guidance_scale", "1"]
]
G2RPO = ["--step_schedule", "g2rpo"]  # branch steps 0–4 (the first half), widths 1 2, summed

SKILL_ARMS = {
    "tp": TP,
    "tp_equal_nfe": lambda cfg: _equal_nfe(cfg, TP),
    "dense_euler1": [*DENSE, "--estimator", "euler", "--substeps", "1"],
    "dense_euler1_cps": ["--credit", "dense", "--estimator", "euler", "--substeps", "1"],
    "dance_psi": ["--sampler", "dance_sde", "--calibrate", "true"],
    "stepwise": [*STEPWISE, "--sampler", "ddim_sde", "--window_start", "1", "--window_size", "4"],
    "stepwise_cps": STEPWISE,
    "dense": DENSE,
    "mixgrpo": lambda cfg: _equal_nfe(cfg, MIXGRPO),
    "tempflow": lambda cfg: _equal_nfe(cfg, [*TEMPFLOW, *SHARED]),
    "egrpo": lambda cfg: _equal_nfe(cfg, [*EGRPO, *SHARED]),
    "grpo_guard": lambda cfg: _equal_nfe(cfg, GUARD),
    "nft_quarter": lambda cfg: _equal_nfe(cfg, NFT, 0.25),
    "awm_quarter": lambda cfg: _equal_nfe(cfg, AWM, 0.25),
    "coca": lambda cfg: _equal_nfe(cfg, COCA),
    "flash": lambda cfg: _equal_nfe(cfg, FLASH),
    "tree": lambda cfg: _equal_nfe(cfg, [*TREE, *SHARED]),
    "branch": lambda cfg: _equal_nfe(cfg, [*BRANCH, *SHARED]),
    "dgpo_quarter": lambda cfg: _equal_nfe(cfg, DGPO, 0.25),
    "g2rpo": lambda cfg: _equal_nfe(cfg, [*G2RPO, *SHARED]),
    "dppo": ["--update", "dppo"],
}
"""The arms beside the preset (Flow-GRPO credit, CPS): TP-GRPO credit at the same iterations and at
the preset's NFE; DenseGRPO (Dance-SDE with ψ calibrated on the frozen base, then dense gains; the
bench calibrates ψ once and hands that one ψ to every seed and every arm that calibrates alike:
bench.shared_psi) with ODE-completed values (``dense``) and, a variant, with one-step values from
the rollout's own velocities (``dense_euler1``: "DenseGRPO with one-step values and one shared ψ",
not DenseGRPO as published); Stepwise-Flow-GRPO with its own DDIM-like SDE (a = 0.7; its first
step, from σ = 1, has std 0, so its window is steps 1–4), euler(5) values and the joint normalisation
that keeps the gains' signs (``stepwise``), and the same credit on the preset's CPS
(``stepwise_cps``: isolates the credit rule). ``dense_euler1`` changes two things, so two
diagnostic arms split it: its credit rule on the preset's CPS (``dense_euler1_cps``) and its sampler
(Dance-SDE with ψ calibrated, the same ψ) under Flow-GRPO's credit (``dance_psi``).
Every other field is the preset's (SDE window: steps 0–4).

The newer methods (docs/benchmarks.md, "The newer methods' claims"), each at the preset's network calls
(:func:`_equal_nfe`) and with the preset's CPS sampler: MixGRPO's progressive window of 2 SDE steps
sliding over steps 0–4 every 25 iterations (``mixgrpo``); TempFlow-GRPO's branches at each of steps
0–4 with its noise-aware weights (``tempflow``); E-GRPO's merged high-entropy branch steps
(``egrpo``); GRPO-Guard's RatioNorm with its 1/Δt step weights (``grpo_guard``). DiffusionNFT and
AWM as their code runs them (rollouts without CFG: DiffusionNFT's deterministic by the old policy,
AWM's Flow-SDE a = 0.57 on steps 0–6; one optimizer step per iteration) at a quarter of the preset's
network calls (``nft_quarter``, ``awm_quarter``), evaluated with the preset's CFG (w = 2) as every arm.
CoCA's credit (``coca``: the preset's rollout, its similarities from the rollout's own velocities, so
the preset's iterations), pre-registered on 2026-12-06 and not run yet. Flash-GRPO (``flash``): one SDE
step per prompt group drawn from the preset's window (steps 0–4), its own SDE (``flash_sde`` at σ_1 =
0.9) and rectification weights; one trained step per trajectory, so more iterations at the preset's
network calls; pre-registered and not run yet. TreeGRPO (``tree``): its tree of 3 × 3 children
from a shared noise (27 leaves per prompt) with the window's start drawn from steps 0–2, so that
its branch steps stay in the preset's window 0–4, at the preset's network calls; pre-registered and
not run yet. BranchGRPO (``branch``): binary splits at steps 0, 1, 3, 4 of one noise per prompt (16
leaves), the preset's CPS on the paths of steps 0–4, ODE after, values z-scored per depth;
pre-registered and not run yet. DGPO (``dgpo_quarter``): deterministic rollouts with the preset's CFG
(as its code samples with CFG) and its group-preference update on the conditional velocity (as its
code trains; 4 shared times, one optimizer step per iteration) at a quarter of the preset's network
calls; pre-registered and not run yet. Flow-DPPO (``dppo``): the preset with the divergence trust
region in place of ratio clipping (``--update dppo`` at τ = 1e-5, the old policy's means from the
rollout: no network call more, so the preset's 450 iterations); pre-registered and not run yet."""
