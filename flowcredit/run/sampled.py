"""What a plan's rollout hands the rest of the iteration (:class:`Sampled`); its own module so that each
rollout shape (:mod:`flowcredit.run.plans`: chains, branches, trees; :mod:`flowcredit.run.group_plans`:
a step per group) returns it without an import loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flowcredit.run.rollout import Rollout


@dataclass
class Sampled:
    """A rollout that followed a plan, over ``B'`` rows (``B' = B·K`` for a branch plan with K branches).

    ``group (B',)`` indexes the iteration's prompts (conditioning, reward); ``norm_group (B',)`` the
    groups advantages are normalised in (``group`` itself without branches); ``row_trained (B', M)``
    the steps each row trains; ``rows`` the ``(total, lo, hi)`` of these rows; ``nfe`` rows × model calls.
    """

    ro: Rollout
    group: torch.Tensor
    norm_group: torch.Tensor
    row_trained: torch.Tensor
    rows: tuple[int, int, int]
    nfe: int
    branches: int = 1
    tree_credit: Callable | None = None

    def shape_credit(self, adv: torch.Tensor) -> torch.Tensor:
        """The advantages ``(B', M)`` of the credit rule, as this rollout's shape trains them: a tree's
        edge values (:func:`flowcredit.tree_plans.tree_advantages`), and only the steps each row trains."""
        if self.tree_credit is not None:
            adv = self.tree_credit(adv)
        return torch.where(self.row_trained, adv, torch.zeros_like(adv))
