"""The reward guard of a training run: every reward call of an iteration goes through :class:`ScoreFn`."""

from __future__ import annotations

import math
import time

import torch

from flowcredit.errors import UserError
from flowcredit.rewards import Reward


class RewardError(UserError):
    """A reward raised or returned a non-finite score; the message names the reward and the prompt."""


class ScoreFn:
    """``score(images (M, 3, H, W), row_index (M,)) -> rewards (M,)`` for one iteration's rows.

    A reward that raises or returns NaN/inf stops the run with the reward and the prompt named; with
    ``skip_bad`` such scores become NaN instead (the trainer then drops their groups and counts them).
    ``components`` keeps each call's per-reward components (for ``reward/<name>`` of a mix);
    ``seconds`` sums the wall clock spent in the reward (calls may overlap model work in a thread).

    Args:
        prompts, metas: the iteration's prompts and their metadata; ``group (B,)`` maps rows to them.
    """

    def __init__(self, reward: Reward, spec: str, prompts, metas, group, skip_bad: bool):
        self.reward, self.spec, self.prompts, self.metas = reward, spec, prompts, metas
        self.group, self.skip_bad = group, skip_bad
        self.components: list[dict[str, torch.Tensor]] = []
        self.seconds = 0.0

    def __call__(self, images, row_index) -> torch.Tensor:
        t0 = time.perf_counter()
        try:
            return self._score(images, row_index)
        finally:
            self.seconds += time.perf_counter() - t0

    def _score(self, images, row_index) -> torch.Tensor:
        p = [self.prompts[j] for j in self.group[row_index].tolist()]
        m = [self.metas[j] for j in self.group[row_index].tolist()]
        try:
            values, components = self.reward.score(images, p, m)
        except Exception as exc:
            if self.skip_bad:
                self.components.append({})  # keeps components[k] aligned with the k-th call
                return torch.full((len(p),), math.nan)
            raise RewardError(f"reward {self.spec!r} failed on prompts like {p[0]!r}: {exc}") from exc
        self.components.append(components)
        bad = ~torch.isfinite(values)
        if bad.any() and not self.skip_bad:
            j = int(torch.nonzero(bad)[0])
            raise RewardError(
                f"reward {self.spec!r} returned {values[j].item()} for prompt {p[j]!r} "
                "(set skip_bad_rewards=true to drop such groups)"
            )
        return torch.where(bad, torch.full_like(values, math.nan), values)
