"""Errors that are the user's to fix (a config field, a file, a prompt, a reward), not bugs.

Every ``flowcredit`` command prints such an error as one line on stderr and exits with status 2
(``flowcredit.cli``); any other exception is a bug and keeps its traceback. Both classes derive from
``ValueError``, so code that catches ``ValueError`` keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input; the message names the culprit (field, file, prompt or reward)."""


class ConfigError(UserError):
    """A config field holds a bad value or contradicts another field."""

    def __init__(self, name: str, message: str):
        super().__init__(f"config field {name!r}: {message}")
        self.field = name
