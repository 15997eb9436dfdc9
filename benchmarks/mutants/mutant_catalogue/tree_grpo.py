"""The mutants of the tree rollouts, TreeGRPO and BranchGRPO (issue 60): the edge values, the edges each
leaf trains, the children's starting states, BranchGRPO's per-depth normalisation and its split noise."""

from __future__ import annotations

from .mutant import Mutant

TREE = "flowcredit/tree_plans.py"
PLANS = "flowcredit/run/plans.py"
TESTS = ("tests/test_tree_plans.py",)

MUTANTS = [
    Mutant(
        "tree_weights_against_the_old_policy", "credit", TREE,
        'w = torch.softmax(logp, dim=-1) if weighting == "prob" else torch.full_like(logp, 1.0 / fanout)',
        'w = torch.softmax(-logp, dim=-1) if weighting == "prob" else torch.full_like(logp, 1.0 / fanout)',
        TESTS, "TreeGRPO weighs a node's children by the inverse of their π_old probabilities",
    ),
    Mutant(
        "tree_every_leaf_trains_every_edge", "plan", TREE,
        "return (leaf.view(-1, 1) % below.view(1, -1) == 0) & sde.view(1, -1)",
        "return (leaf.view(-1, 1) % below.view(1, -1) >= 0) & sde.view(1, -1)",
        TESTS, "a tree's shared edges are trained once per leaf below them, not once",
    ),
    Mutant(
        "tree_children_start_apart", "plan", PLANS,
        "children = last.repeat_interleave(k, 0)",
        "children = last.repeat(k, 1, 1, 1)",
        TESTS, "a tree's children start from other nodes' states: the prefixes are not shared",
    ),
    Mutant(
        "branch_depth_normalisation_skipped", "credit", TREE,
        'if shape.normalize == "depth":',
        'if shape.normalize == "none":',
        TESTS, "BranchGRPO's node values reach the loss without their per-depth z-score",
    ),
    Mutant(
        "branch_split_noise_dropped", "plan", PLANS,
        "wide = scaled_noise(step_fn, shape.split_noise)",
        "wide = step_fn",
        TESTS, "BranchGRPO's splits draw with the step's own noise, not 4 times it",
    ),
]  # fmt: skip
