"""One iteration's steps in the loop: the step schedule's plan (:mod:`flowcredit.step_schedules`), its
sampler levels, and the rollout that follows it (docs/training.md, "One iteration", step 1).

A plan without branches is one trajectory per row on the plan's grid (MixGRPO's window, E-GRPO's merged
steps with ``branch=False``, today's fixed window). A branch plan (TempFlow-GRPO, E-GRPO) explores each of
its SDE steps ``k`` on a branch of its own: the rows of a group share ``x_0`` and so the ODE prefix to
``x_k`` (the *trunk*, computed once per group), take one SDE step at ``k``, then the ODE to the end.
Each row then stands for ``K`` rows ``(r, k)``, ordered row-major so that a rank's rows stay a contiguous
slice of the one-process batch (the noise of a row depends on its global index only); the rows of one
group at one branch step form a *normalisation group* of their own, so the terminal reward's z-score
among them is the process reward of step ``k``.
"""

from __future__ import annotations

import torch

from flowcredit.config import Config
from flowcredit.errors import ConfigError
from flowcredit.run.rollout import Rollout, rollout, seeded
from flowcredit.run.sampled import Sampled
from flowcredit.sde import SAMPLER_ENTRIES, scaled_noise
from flowcredit.step_schedules import StepPlan, make_plan, plan_levels
from flowcredit.validation import schedule_options

PLAN_PURPOSE = 4
"""The :func:`flowcredit.run.rollout.seeded` purpose of a schedule's draws (0–3 are the batch's)."""


def iteration_plan(cfg: Config, sigmas: torch.Tensor, iteration: int) -> StepPlan:
    """The plan of ``cfg.step_schedule`` at ``iteration`` on the grid ``sigmas (N + 1,)``, checked against
    the sampler (a trained step must have noise) and the method (branches share a prefix)."""
    plan = make_plan(
        cfg.step_schedule,
        sigmas,
        level=cfg.noise_level,
        iteration=iteration,
        total=cfg.iterations,
        generator=seeded(cfg.seed, iteration, PLAN_PURPOSE),
        options=schedule_options(cfg),
    )
    entry, where = (
        SAMPLER_ENTRIES[cfg.sampler],
        f"step_schedule {cfg.step_schedule!r} at iteration {iteration}",
    )
    m = plan.sde.numel()
    if entry.first_step_deterministic and bool(plan.trained[0]) and float(plan.sigmas[0]) >= 1.0:
        raise ConfigError("step_schedule", f"{where} trains step 0, where {cfg.sampler} has std 0")
    if entry.last_step_deterministic and bool(plan.trained[m - 1]):
        raise ConfigError("step_schedule", f"{where} trains the last step, where {cfg.sampler} has std 0")
    if (plan.branch or plan.tree is not None) and (cfg.credit != "flow_grpo" or not cfg.shared_noise):
        raise ConfigError(
            "shared_noise" if cfg.credit == "flow_grpo" else "credit",
            f"{where} branches: its rows need shared_noise=true and credit=flow_grpo (a process reward)",
        )
    if plan.tree is not None and cfg.group_size != plan.tree.leaves:
        leaves = plan.tree.leaves
        raise ConfigError("group_size", f"{cfg.group_size}, but {where} grows {leaves} leaves per prompt")
    if plan.group_step is not None:
        _check_group_plan(cfg, where)
    return plan


def _check_group_plan(cfg: Config, where: str) -> None:
    """A per-group plan (Flash-GRPO) trains each row at its group's step: the terminal reward's credit
    and a PPO-style update over trained steps (a forward-process rule would see the other steps)."""
    from flowcredit.updates import UPDATES

    if cfg.credit != "flow_grpo":
        raise ConfigError("credit", f"{where} draws a step per group: it needs credit=flow_grpo")
    if UPDATES[cfg.update].forward:
        raise ConfigError("update", f"{where} draws a step per group: {cfg.update!r} is a forward rule")


def levels_of(plan: StepPlan, cfg: Config, psi: torch.Tensor | None) -> torch.Tensor:
    """``(M,)`` sampler levels of the plan: ``noise_level`` (or DenseGRPO's ψ) on SDE steps, 0 elsewhere."""
    return plan_levels(plan, cfg.noise_level, psi)


def sample(model, cond, group, x0, plan: StepPlan, levels, step_fn, generator, rows, **opts) -> Sampled:
    """Roll out ``x0 (B, …)`` along ``plan`` (:func:`flowcredit.run.rollout.rollout`'s options ``opts``)."""
    if plan.group_step is not None:
        from flowcredit.run.group_plans import group_sample

        return group_sample(model, cond, group, x0, plan, levels, step_fn, generator, rows, **opts)
    if plan.tree is not None:
        return tree_sample(model, cond, group, x0, plan, levels, step_fn, generator, rows, **opts)
    if plan.granular is not None:  # G²RPO: a branch plan with coarser completions
        from flowcredit.run.granular_plans import with_completions

        fine = branch_sample(model, cond, group, x0, plan, levels, step_fn, generator, rows, **opts)
        return with_completions(fine, model, cond, plan, step_fn, **opts)
    if not plan.branch:
        ro = rollout(model, cond, group, x0, plan.sigmas, levels, step_fn, generator, rows=rows, **opts)
        row_trained = plan.trained.view(1, -1).expand(len(group), -1)
        return Sampled(ro, group, group, row_trained, rows, len(group) * plan.sde.numel())
    return branch_sample(model, cond, group, x0, plan, levels, step_fn, generator, rows, **opts)


def tree_sample(model, cond, group, x0, plan: StepPlan, levels, step_fn, generator, rows, **opts) -> Sampled:
    """A tree plan's rollout (:mod:`flowcredit.tree_plans`): one path per group to the first split
    ``t_0``, then at each split ``t_j`` every node's ``k`` children, each following its own path to
    ``t_{j+1}`` (SDE on the plan's SDE steps; a split's draw with its noise × ``split_noise``); the ``B``
    rows are the leaves, each with its path's states, and each transition trained on the first leaf
    below it. Noise: each path's rows are rows of a batch of ``P·k^j`` (``rows`` scaled), so a split over
    processes draws what one process draws."""
    from flowcredit.tree_plans import edge_advantages, owned_steps

    opts = {key: v for key, v in opts.items() if key not in ("keep_uncond", "keep_velocity")}
    shape, m, b = plan.tree, plan.sde.numel(), len(group)
    splits, k, per = list(shape.splits), shape.fanout, shape.leaves
    if b % per or not torch.equal(x0, x0[::per].repeat_interleave(per, 0)):
        raise ValueError(f"a tree plan needs groups of {per} rows sharing x0 (group_size, shared_noise)")
    total, lo, hi = rows
    roots = group[::per]  # (P,) each tree's prompt

    def paths(width, starts, sigmas, lv, step=step_fn):  # the P·width nodes of one depth, each its own path
        scaled = (total // per * width, lo // per * width, hi // per * width)
        nodes = roots.repeat_interleave(width)  # (P·width,) each node's prompt
        return rollout(model, cond, nodes, starts, sigmas, lv, step, generator, rows=scaled, **opts)

    if splits[0]:
        trunk = paths(1, x0[::per], plan.sigmas[: splits[0] + 1], levels[: splits[0]])  # (P, t_0 + 1, …)
    else:  # a split at step 0: the roots are x_0 alone
        x, none = x0[::per].float()[:, None], torch.zeros(len(roots), 0)
        trunk = Rollout(x, none, none, None, x[:, :0] if opts.get("keep_mean") else None)
    segments, nfe, last = [], len(roots) * splits[0], trunk.states[:, -1]
    wide = scaled_noise(step_fn, shape.split_noise)  # a split's draw (its noise × split_noise)
    for j, (s, end) in enumerate(zip(splits, [*splits[1:], m])):
        width = k ** (j + 1)  # nodes of depth j + 1 per tree
        children = last.repeat_interleave(k, 0)  # (P·width, …): each node's k children start from it
        segments.append(paths(width, children, plan.sigmas[s : s + 2], levels[s : s + 1], wide))
        if end > s + 1:  # each child's path on to the next split (the same draws as one segment)
            segments.append(
                paths(width, segments[-1].states[:, -1], plan.sigmas[s + 1 : end + 1], levels[s + 1 : end])
            )
        last, nfe = segments[-1].states[:, -1], nfe + len(roots) * width * (end - s)
    ro = _tree_paths(trunk, segments, per)

    def credit(adv: torch.Tensor) -> torch.Tensor:  # (B, M): the leaves' z-scores → transition values
        return edge_advantages(adv[:, splits[-1]], ro.logp, shape, plan.sde)

    return Sampled(ro, group, group, owned_steps(b, shape, plan.sde), rows, nfe, 1, credit)


def _tree_paths(trunk: Rollout, segments: list[Rollout], per: int) -> Rollout:
    """Each leaf's full trajectory: its tree's trunk, then its ancestor's part of every segment."""
    p = trunk.states.shape[0]
    leaf = torch.arange(p * per)
    tree, within = leaf // per, leaf % per
    parts = [trunk]
    for seg in segments:
        width = seg.states.shape[0] // p
        parts.append(_rows(seg, tree * width + within // (per // width)))  # the leaf's ancestor at this depth
    parts[0] = _rows(trunk, tree)
    states = torch.cat([x.states[:, :-1] for x in parts] + [parts[-1].states[:, -1:]], 1)
    ro = Rollout(states, torch.cat([x.logp for x in parts], 1), torch.cat([x.std for x in parts], 1))
    if all(x.means is not None for x in parts):
        ro.means = torch.cat([x.means for x in parts], 1)
    return ro


def _rows(ro: Rollout, idx: torch.Tensor) -> Rollout:
    return Rollout(
        ro.states[idx], ro.logp[idx], ro.std[idx], None, None if ro.means is None else ro.means[idx]
    )


def branch_sample(
    model, cond, group, x0, plan: StepPlan, levels, step_fn, generator, rows, **opts
) -> Sampled:
    """A branch plan's rollout (module docstring): one trunk per group, one branch per SDE step."""
    if opts.get("keep_velocity"):
        raise ValueError("branch plans keep no velocities (their values are terminal rewards)")
    opts = {k: v for k, v in opts.items() if k != "keep_uncond"}  # a branch's update runs both passes
    ks = torch.nonzero(plan.sde, as_tuple=True)[0].tolist()
    b, m = len(group), plan.sde.numel()
    groups = torch.unique(group)  # sorted
    first = torch.stack([torch.nonzero(group == g)[0, 0] for g in groups])  # (P,) a row of each group
    at_first = torch.searchsorted(groups, group)  # (B,) each row's trunk
    if not torch.equal(x0, x0[first][at_first]):
        raise ValueError("branch plans need the rows of a group to share x0 (shared_noise)")
    trunk = _trunk(model, cond, group[first], x0[first], plan.sigmas[: max(ks) + 1], step_fn, opts)
    parts, nfe = [], len(first) * max(ks)
    for k in ks:
        one = torch.zeros(m - k, dtype=levels.dtype)
        one[0] = levels[k]
        start = trunk[at_first, k]
        branch = rollout(
            model, cond, group, start, plan.sigmas[k:], one, step_fn, generator, rows=rows, **opts
        )
        nfe += b * (m - k)
        parts.append(_with_prefix(branch, trunk, at_first, k))
    ro = Rollout(*(_interleave([getattr(p, f) for p in parts]) for f in ("states", "logp", "std")))
    if parts[0].means is not None:
        ro.means = _interleave([p.means for p in parts])
    n_k = len(ks)
    row_trained = torch.zeros(b, n_k, m, dtype=torch.bool)
    row_trained[:, torch.arange(n_k), torch.tensor(ks)] = True
    total, lo, hi = rows
    return Sampled(
        ro,
        group.repeat_interleave(n_k),
        (group.view(-1, 1) * n_k + torch.arange(n_k)).reshape(-1),
        row_trained.reshape(b * n_k, m),
        (total * n_k, lo * n_k, hi * n_k),
        nfe,
        n_k,
    )


def _trunk(model, cond, group, x0, sigmas, step_fn, opts) -> torch.Tensor:
    """``(P, K + 1, …)``: the ODE states ``x_0 … x_K`` of one row per group (``sigmas (K + 1,)``)."""
    if sigmas.numel() == 1:
        return x0.float()[:, None]
    ode = torch.zeros(sigmas.numel() - 1)
    opts = {k: v for k, v in opts.items() if k in ("logp_mode", "batch_size")}
    return rollout(model, cond, group, x0, sigmas, ode, step_fn, torch.Generator(), **opts).states


def _with_prefix(branch: Rollout, trunk: torch.Tensor, at_first: torch.Tensor, k: int) -> Rollout:
    """A branch from step ``k`` with the trunk's states ``x_0 … x_{k−1}`` (and zero log-density, std and
    mean on those ODE steps) in front: a full-length rollout of the plan."""
    b = len(at_first)
    zeros = torch.zeros(b, k)
    means = None
    if branch.means is not None:
        means = torch.cat([torch.zeros(b, k, *branch.means.shape[2:]), branch.means], 1)
    return Rollout(
        torch.cat([trunk[at_first, :k], branch.states], 1),
        torch.cat([zeros, branch.logp], 1),
        torch.cat([zeros, branch.std], 1),
        None,
        means,
    )


def _interleave(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``K`` tensors ``(B, …)`` → ``(B·K, …)`` with row ``r``'s K entries adjacent (row-major)."""
    return torch.stack(tensors, 1).reshape(-1, *tensors[0].shape[1:])
