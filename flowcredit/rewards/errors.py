"""What a reward call can raise besides a bug: its input unfit (:class:`RewardInputError`) or its own
output malformed (:class:`RewardOutputError`); both re-exported by :mod:`flowcredit.rewards`. A leaf
module, so that the rewards' own modules import them without an import circle."""

from __future__ import annotations

from flowcredit.errors import UserError

__all__ = ["RewardInputError", "RewardOutputError"]


class RewardOutputError(UserError):
    """A reward returned the wrong number of scores (a bug in the reward, not in its input)."""


class RewardInputError(UserError):
    """One sample's input is unfit for a reward: ``field`` (``"images"``, ``"prompts"`` or
    ``"metadata"``) and ``index`` (the sample's position in the call) name it, ``reason`` says why.

    Raised by input checks (e.g. ``shapes`` on metadata without ``'category'``, ``ocr`` on a prompt
    without quotes). The reward server answers it word for word (422, with ``index`` counted in the
    client's request), so ``reason`` quotes only the caller's own input and what the reward accepts
    (keys, classes, an example), never a path or other state of the server's. Any other exception of a
    reward is answered by its type and an error id only (docs/rewards.md, "Remote rewards").
    """

    def __init__(self, field: str, index: int, reason: str):
        super().__init__(f"{field}[{index}]: {reason}")
        self.field, self.index, self.reason = field, index, reason

    def __reduce__(self):
        return type(self), (self.field, self.index, self.reason)

    def at(self, index: int) -> RewardInputError:
        """The same error for the sample at ``index`` (a position in a call → one in a request)."""
        return RewardInputError(self.field, index, self.reason)
