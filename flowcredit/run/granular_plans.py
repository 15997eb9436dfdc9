"""G²RPO's rollout (:mod:`flowcredit.granular`): a branch plan's rollout
(:func:`flowcredit.run.plans.branch_sample`, handed over by :func:`~flowcredit.run.plans.sample`)
whose branches are also completed at coarser granularities.

Each row ``(r, k)`` of the branch plan stands for ``G`` rows ``(r, k, g)`` (``g`` fastest, so that a
rank's rows stay a contiguous slice): ``g = 0`` is the branch itself (its completion on the plan's own
grid, width 1) and the one row that trains step ``k``; ``g ≥ 1`` shares its states up to ``x_{k+1}``
(the one SDE step) and is completed by the ODE on :func:`~flowcredit.granular.completion_grid` at
width ``w_g``, its states after ``x_{k+1}`` "held" on the plan's grid
(:func:`~flowcredit.granular.completion_positions`; only its final state, the one scored, is read).
Every ``(group, k, g)`` is a normalisation group; the credit's z-scores then combine over ``g``
(:func:`~flowcredit.granular.granular_credit`, as :attr:`Sampled.tree_credit`). The coarse completions
are ODE steps: no draw, so a resumed run repeats them.
"""

from __future__ import annotations

from functools import partial

import torch

from flowcredit.granular import completion_grid, completion_positions, granular_credit
from flowcredit.run.rollout import Rollout, rollout
from flowcredit.run.sampled import Sampled
from flowcredit.step_plan import StepPlan


def with_completions(fine: Sampled, model, cond, plan: StepPlan, step_fn, **opts) -> Sampled:
    """``B·K·G`` rows (module docstring) from the ``B·K`` rows of the branch plan's rollout ``fine``;
    ``nfe`` adds the coarse completions' calls (:func:`flowcredit.granular.granular_calls` per row)."""
    shape, ks, m = plan.granular, plan.sde.nonzero()[:, 0].tolist(), plan.sde.numel()
    n_k, n_g = len(ks), len(shape.widths)
    k_of = torch.tensor(ks).repeat(len(fine.group) // n_k)  # (B·K,) each fine row's branch step
    ode_opts = {k: v for k, v in opts.items() if k in ("logp_mode", "batch_size")}
    states, nfe = [fine.ro.states], fine.nfe
    for w in shape.widths[1:]:
        coarse = fine.ro.states.clone()  # (B·K, M + 1, …)
        for k in ks:
            at = torch.nonzero(k_of == k, as_tuple=True)[0]
            grid = completion_grid(plan.sigmas, k, w)  # (L,)
            ode = torch.zeros(grid.numel() - 1)
            path = rollout(
                model,
                cond,
                fine.group[at],
                fine.ro.states[at, k + 1],
                grid,
                ode,
                step_fn,
                torch.Generator(),
                **ode_opts,
            ).states  # (n, L, …)
            coarse[at, k + 1 :] = path[:, completion_positions(m, k, w)].to(coarse.dtype)
            nfe += len(at) * (grid.numel() - 1)
        states.append(coarse)
    ro = Rollout(
        _interleave(states), fine.ro.logp.repeat_interleave(n_g, 0), fine.ro.std.repeat_interleave(n_g, 0)
    )
    if fine.ro.means is not None:
        ro.means = fine.ro.means.repeat_interleave(n_g, 0)
    row_trained = torch.zeros(len(k_of), n_g, m, dtype=torch.bool)
    row_trained[:, 0] = fine.row_trained
    return Sampled(
        ro,
        fine.group.repeat_interleave(n_g),
        (fine.norm_group.view(-1, 1) * n_g + torch.arange(n_g)).reshape(-1),
        row_trained.reshape(-1, m),
        tuple(x * n_g for x in fine.rows),
        nfe,
        fine.branches * n_g,
        tree_credit=partial(granular_credit, shape=shape, steps=n_k),
    )


def _interleave(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``G`` tensors ``(R, …)`` → ``(R·G, …)`` with row ``r``'s G entries adjacent."""
    return torch.stack(tensors, 1).reshape(-1, *tensors[0].shape[1:])
