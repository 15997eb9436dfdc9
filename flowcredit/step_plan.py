"""One iteration's steps (:class:`StepPlan`), which every step schedule returns
(:mod:`flowcredit.step_schedules`; trees: :mod:`flowcredit.tree_plans`), and the sampler levels it gives.
Its own module so that schedules kept in modules of their own build plans without an import loop."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeShape:
    """A tree plan's shape (:mod:`flowcredit.tree_plans`): the rows of a group share ``x_0`` and the path
    to the first split; at each step of ``splits`` every node splits into ``fanout`` children (one
    transition each, of the plan's sampler: SDE at a split), between splits every node follows one path
    (SDE on the plan's SDE steps, ODE elsewhere); a group's ``fanout^len(splits)`` leaves are its rows,
    every transition trained once (on the first leaf below it).

    Attributes:
        fanout: children per split, ``≥ 2``.
        splits: the split steps, increasing; each an SDE step of the plan.
        weighting: how a node's value weighs its children (``"prob"``: softmax of the old policy's
            log-density of the split's transitions; ``"uniform"``).
        normalize: ``"none"``: edge values as they come (TreeGRPO); ``"depth"``: z-scored among the nodes
            of one depth of one tree (BranchGRPO).
        split_noise: the splits' noise multiplier: a child is drawn with the step's noise × it and scored
            under the step's own density (:func:`flowcredit.sde.scaled_noise`; BranchGRPO's 4, 1: none).
    """

    fanout: int
    splits: tuple[int, ...]
    weighting: str = "prob"
    normalize: str = "none"
    split_noise: float = 1.0

    @property
    def leaves(self) -> int:
        return self.fanout ** len(self.splits)


@dataclass(frozen=True)
class GranularShape:
    """G²RPO's multi-granularity completions (:mod:`flowcredit.granular`) of a branch plan: after its SDE
    step ``k`` every branch is also completed by the ODE on coarser grids (``σ_{k+1}``, then every
    ``w``-th σ from ``σ_{k+2}``), each completion scored and z-scored among the branches of its step.

    Attributes:
        widths: the granularities ``w``, strictly increasing, the first 1 (the plan's own grid).
        integration: how a branch's per-granularity z-scores combine
            (:data:`flowcredit.granular.INTEGRATIONS`).
        clip: the combined advantage is clipped to ``±clip``.
    """

    widths: tuple[int, ...]
    integration: str = "sum"
    clip: float = 5.0


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
        tree: None, or a :class:`TreeShape`: the rows of a group are the leaves of a tree
            (:mod:`flowcredit.tree_plans`).
        granular: None, or a :class:`GranularShape` (a branch plan only): G²RPO's coarser completions
            of every branch (:func:`flowcredit.run.granular_plans.with_completions`).
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
    tree: TreeShape | None = None
    group_step: torch.Tensor | None = None
    granular: GranularShape | None = None

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
        if self.tree is not None:
            _check_tree(self)
        if self.group_step is not None:
            _check_group_step(self)
        if self.granular is not None:
            _check_granular(self)


def _check_granular(plan: StepPlan) -> None:
    """G²RPO's completions: a branch plan (no tree, no per-group step), widths ``1 = w_0 < w_1 < …``,
    and every SDE step ``k ≤ M − 2`` (a coarse completion needs a σ after ``σ_{k+1}``)."""
    w, m = plan.granular.widths, plan.sde.numel()
    ok = plan.branch and plan.tree is None and plan.group_step is None and len(w) >= 1 and w[0] == 1
    ok = ok and all(a < b for a, b in zip(w, w[1:])) and not bool(plan.sde[max(m - 1, 0) :].any())
    if not ok:
        sde = plan.sde.nonzero()[:, 0].tolist()
        need = "a branch plan, widths increasing from 1, SDE steps before M - 1"
        raise ValueError(f"StepPlan: G²RPO's completions need {need}; got {plan.granular} on SDE steps {sde}")


def _check_tree(plan: StepPlan) -> None:
    """A tree: ``fanout ≥ 2``, no branch, splits increasing among the SDE steps, every SDE step trained."""
    t, m = plan.tree, plan.sde.numel()
    ok = t.fanout >= 2 and not plan.branch and torch.equal(plan.trained, plan.sde) and len(t.splits) >= 1
    ok = (
        ok
        and list(t.splits) == sorted(set(t.splits))
        and all(0 <= s < m and bool(plan.sde[s]) for s in t.splits)
    )
    if not ok or t.weighting not in ("prob", "uniform") or t.normalize not in ("none", "depth"):
        sde = plan.sde.nonzero()[:, 0].tolist()
        need = "fanout >= 2, splits among its SDE steps, no branch and every SDE step trained"
        raise ValueError(f"StepPlan: a tree needs {need}; got {t} on SDE steps {sde}")


def _check_group_step(plan: StepPlan) -> None:
    """A per-group plan: no branch or tree, and its SDE and trained steps are exactly the groups' steps."""
    taken = torch.zeros_like(plan.sde)
    taken[plan.group_step] = True
    if (
        plan.branch
        or plan.tree is not None
        or not (torch.equal(taken, plan.sde) and torch.equal(taken, plan.trained))
    ):
        raise ValueError(
            "StepPlan: a per-group plan has no branch or tree; sde = trained = the groups' steps"
        )


def plan_levels(plan: StepPlan, level: float, psi: torch.Tensor | None = None) -> torch.Tensor:
    """Per-step sampler levels ``(M,)``: ``level`` on SDE steps (or ``psi (M,)``, DenseGRPO's ψ), 0 on
    ODE steps; what ``flowcredit.run.rollout.rollout`` takes as ``levels``."""
    on = psi if psi is not None else torch.full((plan.sde.numel(),), float(level))
    return torch.where(plan.sde, on, torch.zeros_like(on))
