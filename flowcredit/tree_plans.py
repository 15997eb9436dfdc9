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

from flowcredit.step_plan import StepPlan, TreeShape

TREE_WEIGHTINGS = ("prob", "uniform")


def node_values(leaf: torch.Tensor, split_logp: torch.Tensor, fanout: int, weighting: str = "prob"):
    """The value of each leaf's ancestor at every depth ``(B, d + 1)`` (column ``m``: depth ``m``, ``0`` the
    root, ``d`` the leaf), from ``leaf (B,)`` and ``split_logp (B, d)``.

    Rows are groups of ``k^d`` leaves (``k = fanout``), leaf ``l`` of a group below node ``l // k^{d−m}``
    of depth ``m``. ``V(leaf) = leaf``; a node of depth ``m < d``: ``V(n) = Σ_c w_c V(c)`` over its ``k``
    children, ``w = softmax_c(logp of the split transition n → c)`` (``weighting="prob"``:
    π_old-probability weights among siblings) or ``1/k`` (``"uniform"``: on a full tree, the mean over
    the node's leaves). ``split_logp[r, j]``: the log-density of leaf ``r``'s transition at the ``j``-th
    split (equal on every leaf below it).
    """
    b, d = split_logp.shape
    per = fanout**d
    if b % per or leaf.shape != (b,) or weighting not in TREE_WEIGHTINGS:
        raise ValueError(f"node_values: {b} rows are not groups of {fanout}^{d} leaves, or bad weighting")
    groups = b // per
    value = leaf.reshape(groups, per)  # (P, k^d): values of the depth-d nodes
    columns = [value]
    for m in range(d - 1, -1, -1):  # the values of depth m from those of depth m + 1 (the m-th split)
        below = per // fanout ** (m + 1)  # leaves under each node of depth m + 1
        logp = split_logp[:, m].reshape(groups, per)[:, ::below].reshape(groups, fanout**m, fanout)
        w = torch.softmax(logp, dim=-1) if weighting == "prob" else torch.full_like(logp, 1.0 / fanout)
        value = (w * value.reshape(groups, fanout**m, fanout)).sum(-1)  # (P, k^m)
        columns.insert(0, value)
    # column m holds the values of the k^m nodes of depth m: spread to the leaves below each
    out = [col.repeat_interleave(per // col.shape[1], dim=1).reshape(b) for col in columns]
    return torch.stack(out, dim=1)


def tree_advantages(leaf: torch.Tensor, edge_logp: torch.Tensor, fanout: int, weighting: str = "prob"):
    """TreeGRPO's edge advantages ``(B, d)``: the edge at the ``j``-th split gets ``V`` of the node of depth
    ``j + 1`` it leads to (:func:`node_values` without the root's column)."""
    return node_values(leaf, edge_logp, fanout, weighting)[:, 1:]


def depth_zscore(values: torch.Tensor, fanout: int, eps: float = 1e-4) -> torch.Tensor:
    """BranchGRPO's normalisation: each depth's node values ``(B, d + 1)`` (:func:`node_values`) z-scored
    among the ``k^m`` nodes of that depth of one tree (population std; a depth of one node, or of equal
    values, gives 0), spread back to the leaves."""
    b, d1 = values.shape
    per = fanout ** (d1 - 1)
    out = torch.zeros_like(values)
    for m in range(d1):
        nodes = values[:, m].reshape(b // per, per)[:, :: per // fanout**m]  # (P, k^m)
        centred = nodes - nodes.mean(dim=1, keepdim=True)
        z = centred / (nodes.std(dim=1, unbiased=False, keepdim=True) + eps)
        z = torch.where(centred.abs().amax(dim=1, keepdim=True) > 0, z, torch.zeros_like(z))
        out[:, m] = z.repeat_interleave(per // fanout**m, dim=1).reshape(b)
    return out


def step_depths(splits: tuple[int, ...], m: int) -> torch.Tensor:
    """``(M,)``: the depth of the node each step's transition leads into (splits at or before the step)."""
    return (torch.arange(m).view(-1, 1) >= torch.tensor(splits).view(1, -1)).sum(dim=1)


def owned_steps(b: int, shape: TreeShape, sde: torch.Tensor) -> torch.Tensor:
    """``(B, M)`` bool: leaf ``r`` trains its SDE step ``i`` iff it is the first leaf below that transition
    (below a transition into depth ``m``: ``k^{d−m}`` leaves)."""
    d = len(shape.splits)
    leaf = torch.arange(b) % shape.leaves
    below = shape.fanout ** (d - step_depths(shape.splits, sde.numel()))  # (M,) leaves under each transition
    return (leaf.view(-1, 1) % below.view(1, -1) == 0) & sde.view(1, -1)


def edge_advantages(leaf: torch.Tensor, logp: torch.Tensor, shape: TreeShape, sde: torch.Tensor):
    """``(B, M)``: each SDE step's transition gets the value of the node it leads into (depth-normalised
    for ``shape.normalize == "depth"``), 0 on the ODE steps; ``leaf (B,)``, ``logp (B, M)``."""
    values = node_values(leaf, logp[:, list(shape.splits)], shape.fanout, shape.weighting)  # (B, d + 1)
    if shape.normalize == "depth":
        values = depth_zscore(values, shape.fanout)
    out = values[:, step_depths(shape.splits, sde.numel())]  # (B, M)
    return torch.where(sde.view(1, -1), out, torch.zeros_like(out))


def tree_calls(plan: StepPlan, group_size: int) -> float:
    """Network calls per leaf of one tree plan's rollout: the path to the first split ``t_0`` once per
    group, the path from the ``j``-th split ``(t_{j+1} − t_j)`` steps once per node of depth ``j + 1``
    (``t_d = M``)."""
    splits, k, m = list(plan.tree.splits), plan.tree.fanout, plan.sde.numel()
    ends = [*splits[1:], m]
    calls = splits[0] + sum(k ** (j + 1) * (end - s) for j, (s, end) in enumerate(zip(splits, ends)))
    return calls / group_size


def tree_plan(
    sigmas: torch.Tensor, splits: list[int], fanout: int, weighting: str = "prob", **shape
) -> StepPlan:
    """The tree plan on the grid ``sigmas`` splitting at ``splits`` (increasing) into ``fanout`` children;
    ``shape``: ``sde_steps`` (more SDE steps, each a single transition between splits; default none: the
    ODE between splits), ``normalize`` and ``split_noise`` (:class:`~flowcredit.step_plan.TreeShape`)."""
    n = sigmas.numel() - 1
    sde = torch.zeros(n, dtype=torch.bool)
    sde[list(splits)] = True
    sde[list(shape.get("sde_steps", ()))] = True
    tree = TreeShape(
        fanout, tuple(splits), weighting, shape.get("normalize", "none"), shape.get("split_noise", 1.0)
    )
    return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1), tree=tree)


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


BRANCHGRPO_SPLITS = [0, 1, 3, 4]
"""BranchGRPO's splits on our 10-step grid: theirs, 0, 3, 6, 9 of 20 steps (``TREE_SPLIT_POINTS``), halved
and rounded down."""


def branchgrpo(
    sigmas, *, level, iteration, total, generator, splits=None, fanout=2, skip_last=1,
    weighting="uniform", normalize="depth", split_noise=4.0,
):  # fmt: skip
    """BranchGRPO's tree (module docstring): binary splits at ``splits``, the SDE on every step but the last
    ``skip_last`` (each a transition of its own between splits), node values the mean over their leaves
    (``weighting="uniform"``; ``"prob"``: the authors' ``--tree_prob_weighted``), z-scored per depth; the
    splits' noise × ``split_noise`` (4: their script's ``TREE_SPLIT_NOISE_SCALE``)."""
    n, splits = sigmas.numel() - 1, list(BRANCHGRPO_SPLITS if splits is None else splits)
    return tree_plan(
        sigmas, splits, fanout, weighting, sde_steps=range(n - skip_last), normalize=normalize,
        split_noise=split_noise,
    )  # fmt: skip


def check_branchgrpo(o: dict) -> None:
    """The options of ``branchgrpo``: at least one split, increasing, ``fanout ≥ 2``; the grid checks the
    rest when the plan is built (a split must be an SDE step)."""
    splits = list(BRANCHGRPO_SPLITS if o["splits"] is None else o["splits"])
    if not splits or splits != sorted(set(splits)) or min(splits) < 0 or o["fanout"] < 2:
        raise ValueError(
            f"step schedule 'branchgrpo': option 'splits' {splits} must increase from 0 (fanout >= 2)"
        )
    if o["weighting"] not in TREE_WEIGHTINGS or o["normalize"] not in ("none", "depth") or o["skip_last"] < 0:
        raise ValueError(f"step schedule 'branchgrpo': weighting in {TREE_WEIGHTINGS}, normalize none/depth")
    if not o["split_noise"] > 0:
        raise ValueError(
            f"step schedule 'branchgrpo': option 'split_noise' must be > 0, got {o['split_noise']}"
        )
