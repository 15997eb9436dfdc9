"""Errors that are the user's to fix (a config field, a file, a prompt, a reward), not bugs.

Every ``flowcredit`` command prints such an error as one line on stderr and exits with status 2
(``flowcredit.cli``); any other exception is a bug and keeps its traceback. All classes derive from
``ValueError``, so code that catches ``ValueError`` keeps working.

A path the user names (a checkpoint, a weights folder, a tokenizer file, a prompt set, a ψ file, a
config file, a run to resume) is checked with :func:`existing` and read inside :func:`reading`, so that a
missing, truncated or malformed file is one :class:`PathError` naming the field or flag and the path,
never a traceback. The registries add a net for loaders outside this package:
``flowcredit.rewards.build_reward`` and ``flowcredit.models.load_model`` turn what a reward factory or a
model loader raises while reading into the same kind of error.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class UserError(ValueError):
    """Bad input; the message names the culprit (field, file, prompt or reward)."""


class ConfigError(UserError):
    """A config field holds a bad value or contradicts another field."""

    def __init__(self, name: str, message: str):
        super().__init__(f"config field {name!r}: {message}")
        self.field = name


class PathError(UserError):
    """A file or directory the user named is missing, unreadable or not what it should be.

    ``what`` names where the path came from: a config field (``"config field 'checkpoint'"``), a flag
    (``"--config"``) or a reward option (``"reward 'hps': option 'checkpoint'"``); the message is
    ``what = 'path': problem`` (``--flag 'path': problem`` for a flag), one line.
    """

    def __init__(self, what: str, path, problem: str):
        sep = " " if what.startswith("-") else " = "
        super().__init__(f"{what}{sep}{str(path)!r}: {problem}")
        self.what, self.path = what, str(path)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``exc`` as ``Type: message`` on one line (whitespace collapsed), cut at ``limit`` characters."""
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a file the user named can raise, besides :class:`UserError`: a missing or unreadable
    path (``OSError``), bad text, JSON or numbers (``ValueError``), a truncated or corrupt safetensors,
    YAML or pickle file, and keys or shapes that do not fit (``KeyError``, ``TypeError``, and
    ``load_state_dict``'s ``RuntimeError``). Imported on use: ``flowcredit --help`` stays instant."""
    import pickle

    import yaml
    from safetensors import SafetensorError

    return (
        OSError,
        ValueError,
        EOFError,
        KeyError,
        TypeError,
        RuntimeError,
        pickle.UnpicklingError,
        SafetensorError,
        yaml.YAMLError,
    )


def existing(what: str, path, kind: str = "file", hint: str = "") -> Path:
    """``path`` (``~`` expanded) if it is an existing ``kind`` (``"file"`` or ``"directory"``); a
    :class:`PathError` naming ``what`` and the path otherwise (``hint``: what to do, in parentheses)."""
    p = Path(path).expanduser() if path is not None else None
    if p is None or not (p.is_dir() if kind == "directory" else p.is_file()):
        raise PathError(what, path, f"not an existing {kind}" + (f" ({hint})" if hint else ""))
    return p


@contextmanager
def reading(what: str, path, part: str = "") -> Iterator[None]:
    """Read the file or directory ``path`` (named by ``what``; ``part``: the file inside it being read)
    inside this block: any of :func:`read_errors` becomes one :class:`PathError` naming ``what``, the
    path and the cause; a :class:`UserError` passes unchanged. Keep the block to the reading, so that a
    bug elsewhere stays a bug with its traceback."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        if not isinstance(exc, read_errors()):
            raise
        its = f"its {part}" if part else "it"
        raise PathError(what, path, f"cannot read {its} ({one_line(exc)})") from exc
