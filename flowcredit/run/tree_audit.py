"""The credit audit of a tree rollout (TreeGRPO, BranchGRPO; docs/benchmarks.md, "flowcredit audit"):
each transition's true effect against the credit each tree rule gives it, on one tree per prompt.

A tree's rows are its leaves (:func:`flowcredit.run.plans.tree_sample`); a transition shared by several
leaves is one edge, counted once, on the first leaf below it (``owned``). Its true effect is
``Δ = V(x_{i+1}) − V(x_i)`` with ``V`` the mean reward of ``M`` completions under the tree's sampler
from that state (one path: a completion does not branch), as in :mod:`flowcredit.run.audit`; a state
shared by several rows is completed once (:func:`unique_rows`). The rules (:data:`TREE_RULES`) all
start from the leaves' z-scored rewards and differ in what an edge gets: its own first leaf's
(``flow_grpo``: what a flat rollout's update gives a transition), or the value of the node it leads to
with the children weighed by the old policy's probabilities (``treegrpo``), uniformly (``uniform``),
uniformly and z-scored per depth (``branchgrpo``). Spearman's ρ is taken per (prompt, step) over the
edges of that step (:func:`flowcredit.credit_audit.group_step_spearman` with ``owned``).
"""

from __future__ import annotations

import dataclasses

import torch

from flowcredit.advantages import CREDITS
from flowcredit.config import Config
from flowcredit.rewards.guard import ScoreFn
from flowcredit.run.audit import GroupAudit, mc_needed
from flowcredit.run.rollout import rollout
from flowcredit.schedule import sigmas as schedule
from flowcredit.sde import SAMPLERS
from flowcredit.step_plan import plan_levels
from flowcredit.tree_plans import edge_advantages
from flowcredit.validation import credit_options

TREE_RULES: dict[str, tuple[str, str] | None] = {
    "flow_grpo": None,
    "treegrpo": ("prob", "none"),
    "uniform": ("uniform", "none"),
    "branchgrpo": ("uniform", "depth"),
}
"""``rule → (weighting, normalize)`` of the edge values (:class:`flowcredit.step_plan.TreeShape`);
``None``: each edge its own first leaf's z-score."""


def unique_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)`` of the rows of ``x (B, …)``: ``first (U,)`` the first row of each distinct
    value in order of appearance, ``inverse (B,)`` the position in ``first`` of each row's value."""
    flat = x.reshape(x.shape[0], -1)
    same = (flat[:, None] == flat[None]).all(-1)  # (B, B)
    earliest = same.to(torch.int64).argmax(1)  # (B,) the first row equal to each
    first = torch.unique(earliest)  # sorted: the order of appearance
    return first, torch.searchsorted(first, earliest)


@torch.no_grad()
def tree_completions(
    model, cond, group, states, sigmas, levels, trained, step_fn, score, m: int, generator, bs
):
    """``(B, N + 1, m)`` rewards: each distinct state ``i`` that ends a ``trained (N,)`` transition
    completed ``m`` times under ``levels[i:]`` (rows sharing a state share its completions), the final
    states scored as they are, a state with no noisy step after it repeating its successor's, any other
    state NaN (no trained transition reads it); and the network rows run."""
    b, n = states.shape[0], states.shape[1] - 1
    out = torch.full((b, n + 1, m), torch.nan, dtype=torch.float64)
    out[:, n] = score(model.decode(states[:, n]), torch.arange(b)).double()[:, None]
    ends = torch.cat([trained, torch.zeros(1, dtype=torch.bool)]) | torch.cat(
        [torch.zeros(1, dtype=torch.bool), trained]
    )
    need, calls = mc_needed(levels), 0
    for i in range(n - 1, -1, -1):
        if not need[i]:
            out[:, i] = out[:, i + 1]
            continue
        if not ends[i]:
            continue
        first, inverse = unique_rows(states[:, i])
        rows = first.repeat_interleave(m)  # (U·m,)
        sub = rollout(
            model,
            cond,
            group[rows],
            states[rows, i],
            sigmas[i:],
            levels[i:],
            step_fn,
            generator,
            batch_size=bs,
        )
        calls += len(rows) * (n - i)
        rewards = score(model.decode(sub.states[:, -1]), rows).double().view(len(first), m)
        out[:, i] = rewards[inverse]
    return out, calls


def tree_audit_group(model, cfg: Config, reward, metas: list[dict], m: int, seed: int = 0, index: int = 0):
    """One tree of ``cfg``'s tree plan (its draw for group ``index``) for the prompt ``metas[0]``: the
    rules' edge credit against the completions' ``Δ̂`` (a :class:`GroupAudit` with ``owned``)."""
    from flowcredit.run.plans import iteration_plan, tree_sample

    g_init, g_sde, g_mc = (torch.Generator().manual_seed(seed * 1_000_003 + index * 7 + k) for k in range(3))
    plan = iteration_plan(dataclasses.replace(cfg, seed=seed), schedule(cfg.num_steps, cfg.shift), index)
    if plan.tree is None:
        from flowcredit.errors import ConfigError

        raise ConfigError("step_schedule", f"{cfg.step_schedule!r} is not a tree plan (treegrpo, branchgrpo)")
    levels, leaves, step_fn = plan_levels(plan, cfg.noise_level), plan.tree.leaves, SAMPLERS[cfg.sampler]
    prompts, group = [metas[0]["prompt"]], torch.zeros(leaves, dtype=torch.long)
    x0 = torch.randn((1, *model.latent_shape), generator=g_init).expand(leaves, *model.latent_shape)
    with torch.no_grad():
        cond = model.encode(prompts)
        sam = tree_sample(
            model, cond, group, x0.contiguous(), plan, levels, step_fn, g_sde, (leaves, 0, leaves),
            logp_mode=cfg.logp_mode, batch_size=cfg.batch_size,
        )  # fmt: skip
    score = ScoreFn(reward, cfg.reward, prompts, metas[:1], group, False)
    ro = sam.ro
    completions, calls = tree_completions(
        model, cond, group, ro.states, plan.sigmas, levels, plan.sde, step_fn, score, m, g_mc, cfg.batch_size
    )
    final = completions[:, -1, :1].float().expand(-1, plan.sde.numel() + 1)  # (B, N + 1): V_N
    kwargs = {
        "eps": cfg.adv_eps,
        "adv_clip": cfg.adv_clip,
        **credit_options(dataclasses.replace(cfg, credit_options="")),
    }
    leaf = CREDITS["flow_grpo"].fn(final, group, plan.sde, **kwargs)  # (B, N) each leaf's z-score
    credit = {}
    for name, shape in TREE_RULES.items():
        if shape is None:
            credit[name] = leaf
            continue
        variant = dataclasses.replace(plan.tree, weighting=shape[0], normalize=shape[1])
        credit[name] = edge_advantages(leaf[:, plan.tree.splits[-1]], ro.logp, variant, plan.sde)
    nfe = dict.fromkeys(credit, 0.0)
    return GroupAudit(completions, credit, nfe, calls / leaves, plan.sde.clone(), owned=sam.row_trained)
