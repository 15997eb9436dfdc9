"""Tree rollouts (docs/algorithms.md, "Tree rollouts: TreeGRPO"): the plan, its credit and its cost.

A tree plan (:class:`~flowcredit.step_schedules.StepPlan` with ``fanout = k ≥ 2``) has ``d`` SDE steps
``s_0 < … < s_{d−1}``. The ``k^d`` rows of a group share ``x_0`` (``shared_noise``) and one ODE trunk to
``x_{s_0}``; at each ``s_j`` every node of depth ``j`` splits into ``k`` children, each one SDE step with
noise of its own, and runs the ODE to ``s_{j+1}`` (the last ones to the end). The group's rows are its
leaves, ordered so that leaf ``l``'s ancestor of depth ``j`` is node ``l // k^{d−j}``
(:func:`flowcredit.run.plans.tree_sample` rolls it out). An edge is trained once, on the first leaf
below it; its advantage is the value of the node it leads to (:func:`tree_advantages`).

Entries:
- ``treegrpo`` (TreeGRPO, Ding & Ye, arXiv 2512.08153, ICLR 2026): a window of ``depth`` consecutive SDE
  steps from a start drawn from a truncated geometric distribution, ``fanout`` 3, ``depth`` 3 (the paper's
  default tree, 27 leaves per prompt); leaf advantages are the per-prompt z-scores of the reward; an
  edge's advantage is the π_old-probability-weighted mean of its children's. No public code exists and
  the paper's full text could not be read here: the equations follow the issue's summary of Eq. 7–12
  (from a secondary note). Our choices where that is silent: the geometric's parameter ``p`` (0.5, start
  0 most likely: TreeGRPO branches early), the π_old weights as a softmax over the siblings' log-densities
  (our log-density is the per-dimension mean, :func:`flowcredit.sde.gaussian_logp`; the raw density of a
  whole image would put all weight on one child), and the last ``skip_last`` steps never branching.

A new tree shape is one schedule function returning such a plan plus ``register_step_schedule``
(tests/test_tree_plans.py registers a toy one from outside the package). :mod:`flowcredit.step_schedules`
imports this module and registers ``treegrpo``.
"""

from __future__ import annotations

import torch

from flowcredit.step_plan import StepPlan

TREE_WEIGHTINGS = ("prob", "uniform")


def tree_advantages(leaf: torch.Tensor, edge_logp: torch.Tensor, fanout: int, weighting: str = "prob"):
    """Each leaf's advantage at each of its ``d`` edges ``(B, d)``, from ``leaf (B,)``, ``edge_logp (B, d)``.

    Rows are groups of ``k^d`` leaves (``k = fanout``), leaf ``l`` of a group below node ``l // k^{d−m}`` of
    depth ``m``. Values: ``V(leaf) = leaf``; a node of depth ``m < d``:
    ``V(n) = Σ_c w_c V(c)`` over its ``k`` children ``c``, ``w = softmax_c(logp of the edge n → c)``
    (``weighting="prob"``: π_old-probability weights among siblings) or ``1/k`` (``"uniform"``). The edge
    at depth ``j`` (``s_j``, into a node of depth ``j + 1``) gets ``V`` of that node: column ``j`` of the
    result. ``edge_logp[r, j]`` is the log-density of leaf ``r``'s edge at ``s_j`` (equal on every leaf
    below that edge).
    """
    b, d = edge_logp.shape
    per = fanout**d
    if b % per or leaf.shape != (b,) or weighting not in TREE_WEIGHTINGS:
        raise ValueError(f"tree_advantages: {b} rows are not groups of {fanout}^{d} leaves, or bad weighting")
    groups = b // per
    value = leaf.reshape(groups, per)  # (P, k^d): values of the depth-d nodes
    columns = [value]
    for m in range(d - 1, 0, -1):  # the values of depth m from those of depth m + 1 (edges at s_m)
        below = per // fanout ** (m + 1)  # leaves under each node of depth m + 1
        logp = edge_logp[:, m].reshape(groups, per)[:, ::below].reshape(groups, fanout**m, fanout)
        w = torch.softmax(logp, dim=-1) if weighting == "prob" else torch.full_like(logp, 1.0 / fanout)
        value = (w * value.reshape(groups, fanout**m, fanout)).sum(-1)  # (P, k^m)
        columns.insert(0, value)
    # column j holds the values of the k^{j+1} nodes of depth j + 1: spread to the leaves below each
    out = [col.repeat_interleave(per // col.shape[1], dim=1).reshape(b) for col in columns]
    return torch.stack(out, dim=1)


def owned_edges(b: int, fanout: int, depth: int) -> torch.Tensor:
    """``(B, d)`` bool: leaf ``r`` trains its edge at ``s_j`` iff it is the first leaf below that edge."""
    leaf = torch.arange(b) % fanout**depth
    below = torch.tensor([fanout ** (depth - 1 - j) for j in range(depth)])  # leaves under an edge of depth j
    return leaf.view(-1, 1) % below.view(1, -1) == 0


def tree_calls(plan: StepPlan, group_size: int) -> float:
    """Network calls per leaf of one tree plan's rollout: the trunk (``s_0`` steps) once per group, each
    depth-``j`` segment ``(s_{j+1} − s_j)`` steps once per node of depth ``j + 1`` (``s_d = M``)."""
    steps = plan.sde.nonzero()[:, 0].tolist()
    k, m = plan.fanout, plan.sde.numel()
    ends = [*steps[1:], m]
    calls = steps[0] + sum(k ** (j + 1) * (end - s) for j, (s, end) in enumerate(zip(steps, ends)))
    return calls / group_size


def tree_plan(sigmas: torch.Tensor, steps: list[int], fanout: int, weighting: str = "prob") -> StepPlan:
    """The tree plan on the grid ``sigmas`` branching at ``steps`` (increasing) into ``fanout`` children."""
    n = sigmas.numel() - 1
    sde = torch.zeros(n, dtype=torch.bool)
    sde[steps] = True
    return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1), fanout=fanout, tree_weighting=weighting)


def truncated_geometric(last: int, p: float, generator: torch.Generator) -> int:
    """A draw of ``i ∈ {0, …, last}`` with probability ∝ ``p (1 − p)^i``."""
    weights = p * (1 - p) ** torch.arange(last + 1, dtype=torch.float64)
    return int(torch.multinomial(weights, 1, generator=generator))


def treegrpo(
    sigmas, *, level, iteration, total, generator, fanout=3, depth=3, p=0.5, skip_last=1, weighting="prob"
):
    """TreeGRPO's tree (module docstring): ``depth`` consecutive branch steps from ``s ~`` a geometric
    distribution (parameter ``p``) truncated to ``[0, N − skip_last − depth]``, ``fanout`` children each.
    ``weighting`` is read by the credit (:func:`tree_advantages`) through the plan's options."""
    n = sigmas.numel() - 1
    last = n - skip_last - depth
    if last < 0:
        _fail("depth", f"{depth} (skip_last {skip_last}) does not fit {n} steps")
    start = truncated_geometric(last, p, generator)
    return tree_plan(sigmas, list(range(start, start + depth)), fanout, weighting)


def _fail(option: str, message: str) -> None:
    raise ValueError(f"step schedule 'treegrpo': option {option!r} {message}")


def check_treegrpo(o: dict) -> None:
    """The options of ``treegrpo`` (registered in :mod:`flowcredit.step_schedules`)."""
    if o["fanout"] < 2 or o["depth"] < 1:
        _fail("fanout", f"needs fanout >= 2 and depth >= 1, got {o}")
    if not 0 < o["p"] <= 1:
        _fail("p", f"must lie in (0, 1], got {o['p']}")
    if o["skip_last"] < 0 or o["weighting"] not in TREE_WEIGHTINGS:
        _fail("weighting", f"one of {TREE_WEIGHTINGS}; skip_last >= 0")
