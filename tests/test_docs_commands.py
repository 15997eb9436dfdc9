"""The commands the documentation shows exist: every ``flowcredit COMMAND --flag …`` in README.md and
docs/*.md names a command of ``flowcredit.cli.COMMANDS`` and flags its parser accepts, and every
``make TARGET`` names a target of the Makefile. A renamed flag or command fails here, not in a reader's
terminal. Parsers only: nothing runs."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from flowcredit import cli
from flowcredit.cli_args import other_spellings
from flowcredit.config import Config

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

PARSERS = {
    "train": "flowcredit.commands.train:_parser",
    "calibrate": "flowcredit.commands.calibrate:_parser",
    "eval": "flowcredit.commands.eval:_eval_parser",
    "sample": "flowcredit.commands.eval:_sample_parser",
    "pretrain": "flowcredit.commands.pretrain:build_parser",
    "bench": "flowcredit.commands.bench:_parser",
    "audit": "flowcredit.commands.audit:_parser",
    "serve-reward": "flowcredit.rewards.server:_parser",
    "demo": "flowcredit.commands.demo:_parser",
    "memory": "flowcredit.commands.memory:_parser",
}
"""Each command's parser (None: the command takes config fields only)."""

COMMAND = re.compile(r"(?:^|[\s/])flowcredit\s+([a-z][\w-]*)(.*)")
STOP = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def code_lines(text: str) -> list[str]:
    """The shell lines of ``text``: fenced code blocks (``\\``-continued lines joined) and inline code
    spans that start with a command."""
    lines, fenced, held = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            held += line.rstrip()
            if held.endswith("\\"):
                held = held[:-1] + " "
                continue
            lines.append(held)
            held = ""
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    spans = [" ".join(s.split()) for s in spans if "\n\n" not in s]  # a span may wrap, once
    return lines + [s for s in spans if re.match(r"(\S*/)?(flowcredit|make) ", s)]


def invocations(path: Path) -> list[tuple[str, str, list[str]]]:
    """``(line, command, flags)`` of every ``flowcredit COMMAND …`` in ``path``'s code."""
    found = []
    for line in code_lines(path.read_text(encoding="utf-8")):
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unclosed quote: a line of a longer example
            words = line.split("#")[0].split()
        text = " ".join(words)
        m = COMMAND.search(text)
        if m is None:
            continue
        flags = []
        for word in m.group(2).split():
            if word in STOP:
                break
            if word.startswith("--"):
                flags.append(word.split("=", 1)[0])
        found.append((line.strip(), m.group(1), flags))
    return found


def _accepted(command: str) -> set[str]:
    fields = {f"--{name}" for name in Config.__dataclass_fields__}
    if PARSERS[command] is None:
        return fields | {s for f in fields for s in other_spellings(f)}
    module, name = PARSERS[command].split(":")
    parser = getattr(importlib.import_module(module), name)()
    return set(parser._option_string_actions)


def test_every_command_has_its_parser_here():
    assert set(PARSERS) == set(cli.COMMANDS)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_exist_and_take_their_flags(doc):
    bad = []
    for line, command, flags in invocations(doc):
        if command not in cli.COMMANDS:
            bad.append(f"{line!r}: no command {command!r}")
            continue
        unknown = [f for f in flags if f not in _accepted(command)]
        if unknown:
            bad.append(f"{line!r}: {command} takes no {', '.join(unknown)}")
    assert not bad, f"{doc.name}:\n" + "\n".join(bad)


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+)\s*:(?!=)", text, flags=re.M))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_make_targets_exist(doc):
    targets = _make_targets()
    named = set()
    for line in code_lines(doc.read_text(encoding="utf-8")):
        named |= set(re.findall(r"(?:^|&&\s*|;\s*)make\s+([\w-]+)", line.strip()))
    assert named <= targets, f"{doc.name}: no Makefile target {sorted(named - targets)}"


def test_the_scan_finds_what_it_should():
    """The scans above can fail: they see the README's commands, a flag and a make target."""
    seen = {(command, tuple(flags)) for _, command, flags in invocations(REPO / "README.md")}
    assert ("calibrate", ("--run_dir",)) in seen
    assert ("eval", ("--checkpoint", "--prompts", "--seeds")) in seen
    readme = code_lines((REPO / "README.md").read_text())
    assert any(line.startswith("make demo") for line in readme)
    assert "--samples_per_prompt" in _accepted("eval") and "--group-size" in _accepted("demo")
