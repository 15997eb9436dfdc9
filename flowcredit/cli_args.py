"""The argument parser every ``flowcredit`` command uses, and the config fields as documented flags.

:class:`ArgParser` is an :class:`argparse.ArgumentParser` that

1. accepts both spellings of every long option (``--samples-per-prompt`` and ``--samples_per_prompt``;
   the commands grew up with both) while ``--help`` shows the one it was declared with;
2. takes no abbreviations (``allow_abbrev=False``): ``flowcredit bench --seed 3`` used to be read as
   ``--seeds 3`` in silence, now it is an error naming ``--seed``.

:func:`add_config_fields` adds every field of :class:`~flowcredit.config.Config` as an option, grouped by
the ``# --- section ---`` comments of ``config.py``, with its one-line attribute docstring, type and
default as its help, so ``flowcredit train --help`` lists every setting. These options only collect the
raw strings, in command-line order (:meth:`ArgParser.parse_with_overrides`); the typing, the checks and
the messages stay where they were: ``load_config`` (preset → YAML → overrides) → ``apply_overrides`` →
``parse_value``.

Why argparse built from the dataclass rather than tyro or jsonargparse: no new dependency for a few dozen
lines; those libraries build and type-check the dataclass while parsing, but a config here is a preset,
then a YAML file, then the flags, in that order, and the modules named by ``--imports`` must be imported
before anything is validated (a plugin may register the very preset or credit method the flags name);
and our errors are one line naming the field, with "did you mean" for a misspelt key, not a usage dump.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import functools
import inspect
import re
import sys
import textwrap
import typing

from flowcredit.config import Config

CONFIG_ORDER = (
    "A config is built in this order, later wins: the preset (--preset), a YAML or JSON file of fields "
    "(--config), then the flags below. Modules named by --imports are imported first, so they may register "
    "presets, credit methods or samplers. Every flag has both spellings (--run_dir, --run-dir); booleans "
    "take a value (--calibrate true). The defaults shown are Config's; a preset changes some of them."
)
"""How a preset, ``--config`` and the config flags combine: the help of the commands that take all three."""

OVERRIDES = "config_overrides"
"""The namespace attribute the config-field options collect their ``["--field", "raw"]`` pairs in."""


def other_spellings(flag: str) -> list[str]:
    """The other spellings of a long option: ``--a-b`` ↔ ``--a_b`` (none for ``-x`` or ``--ab``)."""
    if not flag.startswith("--"):
        return []
    body = flag[2:]
    return [f"--{s}" for s in dict.fromkeys((body.replace("-", "_"), body.replace("_", "-"))) if s != body]


class _Spellings:
    """``add_argument`` registering every spelling; the added ones are kept on the action so that the
    help shows only the declared one."""

    def add_argument(self, *args, **kwargs):
        extra = [alt for flag in args for alt in other_spellings(flag) if alt not in args]
        action = super().add_argument(*args, *extra, **kwargs)
        action.other_spellings = tuple(extra)
        return action


class _Group(_Spellings, argparse._ArgumentGroup):
    """An argument group with both spellings (argparse groups have their own ``add_argument``)."""


class _Exclusive(_Spellings, argparse._MutuallyExclusiveGroup):
    """A mutually exclusive group with both spellings."""


class HelpFormatter(argparse.HelpFormatter):
    """Shows an option once, as declared, not with its added spelling."""

    def _format_action_invocation(self, action):
        hidden = getattr(action, "other_spellings", ())
        if hidden:
            action = copy.copy(action)
            action.option_strings = [s for s in action.option_strings if s not in hidden]
        return super()._format_action_invocation(action)


class ArgParser(_Spellings, argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with both spellings of long options and no abbreviations."""

    def __init__(self, *args, allow_abbrev: bool = False, formatter_class=HelpFormatter, **kwargs):
        super().__init__(*args, allow_abbrev=allow_abbrev, formatter_class=formatter_class, **kwargs)

    def add_argument_group(self, *args, **kwargs):
        group = _Group(self, *args, **kwargs)
        self._action_groups.append(group)
        return group

    def add_mutually_exclusive_group(self, **kwargs):
        group = _Exclusive(self, **kwargs)
        self._mutually_exclusive_groups.append(group)
        return group

    def parse_with_overrides(self, argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
        """``(options, overrides)``: the command's own options, and ``["--field", "raw", …]`` for
        ``load_config``: the config fields given (canonical ``--a_b`` names, in command-line order),
        then whatever no option took (``--k=v`` split in two), left for ``load_config`` to refuse
        with its own message ("unknown config key 'grop_size'; did you mean 'group_size'?").

        A config field's value is the next word whatever it looks like (``--shift -1e-3``), as the
        ``--key value`` pairs always were: argparse would take ``-1e-3`` for an option."""
        argv, joined = list(sys.argv[1:] if argv is None else argv), []
        while argv:
            word = argv.pop(0)
            if isinstance(self._option_string_actions.get(word), _Override) and argv:
                word = f"{word}={argv.pop(0)}"
            joined.append(word)
        args, rest = self.parse_known_args(joined)
        pairs = list(vars(args).pop(OVERRIDES, []))
        rest = [part for w in rest for part in (w.split("=", 1) if w.startswith("--") and "=" in w else [w])]
        return args, pairs + rest


class _Override(argparse.Action):
    """Appends ``["--field", raw]`` to :data:`OVERRIDES` (typed and checked later, by ``load_config``)."""

    def __init__(self, option_strings, dest, field: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.field = field

    def __call__(self, parser, namespace, values, option_string=None):
        pairs = list(getattr(namespace, OVERRIDES, []))
        setattr(namespace, OVERRIDES, [*pairs, f"--{self.field}", values])


@functools.cache
def config_sections() -> dict[str, list[tuple[str, str]]]:
    """``{section: [(field, doc), …]}`` in ``config.py``'s order: the sections are its
    ``# --- title ---`` comments, a field's doc the string literal after it (whitespace folded).
    Read from the source because attribute docstrings exist only there."""
    source = textwrap.dedent(inspect.getsource(Config))
    titles = {
        i: m.group(1)
        for i, line in enumerate(source.splitlines(), 1)
        if (m := re.match(r"\s*# --- (.+?) ---", line))
    }
    body = ast.parse(source).body[0].body
    sections: dict[str, list[tuple[str, str]]] = {}
    for node, after in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        title = titles[max((i for i in titles if i < node.lineno), default=min(titles))]
        literal = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        doc = " ".join(after.value.value.split()) if literal else ""
        sections.setdefault(title, []).append((node.target.id, doc))
    return sections


def _help(doc: str, default) -> str:
    doc = doc.replace("``", "").replace("%", "%%")  # argparse formats help with %
    shown = str(default).lower() if isinstance(default, bool) else repr(default)  # as typed: true, false
    return f"{doc} (default {shown})"


def add_config_fields(parser: ArgParser, skip: tuple[str, ...] = (), heading: str = "config") -> None:
    """Every config field as ``--field VALUE``, one argument group per ``config.py`` section, with its
    doc, type and default; a field the parser already has an option of that name for is left out (the
    command's own option wins), as are those in ``skip``. Booleans take a value (``--calibrate true``)."""
    if parser.usage is None:  # the command's own options, then one mark for the ~90 fields
        own = parser.format_usage().removeprefix("usage: ").rstrip("\n").replace("%", "%%")
        parser.usage = f"{own} [--FIELD VALUE ...]"
    hints, defaults = typing.get_type_hints(Config), Config()
    fields = {f.name for f in dataclasses.fields(Config)} - set(skip)
    for title, entries in config_sections().items():
        group = parser.add_argument_group(f"{heading}: {title}")
        for name, doc in entries:
            if name not in fields or f"--{name}" in parser._option_string_actions:
                continue
            kind = hints[name]
            group.add_argument(
                f"--{name}",
                action=_Override,
                field=name,
                dest=OVERRIDES,
                default=argparse.SUPPRESS,
                metavar="{true,false}" if kind is bool else kind.__name__.upper(),
                help=_help(doc, getattr(defaults, name)),
            )
