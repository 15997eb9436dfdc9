"""One iteration's steps (:class:`StepPlan`), which every step schedule returns
(:mod:`flowcredit.step_schedules`; trees: :mod:`flowcredit.tree_plans`), and the sampler levels it gives.
Its own module so that schedules kept in modules of their own build plans without an import loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepPlan:
    """One iteration's steps: the grid to follow and which of its ``M`` steps explore and train.

    Attributes:
        sigmas: ``(M + 1,)`` the rollout's grid, decreasing from ``sigmas[0]`` to ``sigmas[M]``.
        sde: ``(M,)`` bool, steps sampled with the SDE (the others take the ODE step).
        trained: ``(M,)`` bool, steps whose log-probability enters the loss; a subset of ``sde``.
        grid_index: ``(M + 1,)`` int64, where each σ of the plan sits in the input grid (``0 … N``,
            strictly increasing; ``arange(N + 1)`` when nothing is merged).
        branch: False: one trajectory per row with every SDE step in it. True: every SDE step ``k`` is
            explored on a branch of its own: ODE to ``x_k`` (the prefix shared by all branches of a
            row), one SDE step at ``k``, ODE to the end.
        fanout: 0: no tree. ``k ≥ 2``: a tree (:mod:`flowcredit.tree_plans`): the rows of a group share
            ``x_0`` and the ODE to the first SDE step; at each SDE step every node splits into ``k``
            children (one SDE step each), ODE between; a group's ``k^d`` leaves (``d`` SDE steps) are
            its rows, each edge trained once.
        tree_weighting: how a tree's node values weigh their children
            (:data:`flowcredit.tree_plans.TREE_WEIGHTINGS`).
        group_step: None, or ``(P,)`` int64 for the ``P`` prompt groups of the iteration: a *per-group
            plan* (Flash-GRPO, :mod:`flowcredit.step_schedule_flash`): the rows of group ``g`` take the
            ODE everywhere but one SDE (trained) step ``group_step[g]``; ``sde`` and ``trained`` are the
            steps some group takes (:func:`flowcredit.run.plans.group_sample`).
    """

    sigmas: torch.Tensor
    sde: torch.Tensor
    trained: torch.Tensor
    grid_index: torch.Tensor
    branch: bool = False
    fanout: int = 0
    tree_weighting: str = "prob"
    group_step: torch.Tensor | None = None

    def __post_init__(self):
        m = self.sde.numel()
        if self.sigmas.shape != (m + 1,) or self.trained.shape != (m,) or self.grid_index.shape != (m + 1,):
            raise ValueError(
                f"StepPlan shapes disagree: sigmas {tuple(self.sigmas.shape)}, sde {tuple(self.sde.shape)}, "
                f"trained {tuple(self.trained.shape)}, grid_index {tuple(self.grid_index.shape)}"
            )
        if self.sde.dtype != torch.bool or self.trained.dtype != torch.bool:
            raise ValueError("StepPlan: sde and trained must be bool tensors")
        if bool((self.trained & ~self.sde).any()):
            raise ValueError("StepPlan: a trained step must be an SDE step (an ODE step has no log-density)")
        if m and not bool((self.grid_index[1:] > self.grid_index[:-1]).all()):
            raise ValueError(f"StepPlan: grid_index must increase strictly, got {self.grid_index.tolist()}")
        if self.fanout and (self.fanout < 2 or self.branch or not torch.equal(self.trained, self.sde)):
            raise ValueError("StepPlan: a tree needs fanout >= 2, no branch, and every SDE step trained")
        if self.group_step is not None:
            _check_group_step(self)


def _check_group_step(plan: StepPlan) -> None:
    """A per-group plan: no branch or tree, and its SDE and trained steps are exactly the groups' steps."""
    taken = torch.zeros_like(plan.sde)
    taken[plan.group_step] = True
    if plan.branch or plan.fanout or not (torch.equal(taken, plan.sde) and torch.equal(taken, plan.trained)):
        raise ValueError(
            "StepPlan: a per-group plan has no branch or tree; sde = trained = the groups' steps"
        )


def plan_levels(plan: StepPlan, level: float, psi: torch.Tensor | None = None) -> torch.Tensor:
    """Per-step sampler levels ``(M,)``: ``level`` on SDE steps (or ``psi (M,)``, DenseGRPO's ψ), 0 on
    ODE steps; what ``flowcredit.run.rollout.rollout`` takes as ``levels``."""
    on = psi if psi is not None else torch.full((plan.sde.numel(),), float(level))
    return torch.where(plan.sde, on, torch.zeros_like(on))
