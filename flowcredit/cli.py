"""``flowcredit`` command line: a thin dispatcher to each command's ``main(argv)``.

Modules are imported only when their command runs, so ``flowcredit --help`` is instant. A user error
(:class:`flowcredit.errors.UserError`: a bad config field, file, prompt or reward) is printed as one
line on stderr with exit status 2; set ``FLOWCREDIT_TRACEBACK=1`` to see its traceback too. Any other
exception is a bug and shows its traceback. A ``KeyboardInterrupt`` (a second Ctrl-C, after which
training has printed what it kept) exits with status 130, the shell's code for SIGINT, quietly.
"""

from __future__ import annotations

import importlib
import os
import sys

from flowcredit.errors import UserError

COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("flowcredit.commands.train", "main", "GRPO fine-tuning with step-level credit assignment"),
    "calibrate": ("flowcredit.commands.calibrate", "main", "DenseGRPO exploration-space calibration of ψ"),
    "eval": ("flowcredit.commands.eval", "main_eval", "evaluate a checkpoint on ShapeEval prompts"),
    "sample": ("flowcredit.commands.eval", "main_sample", "sample images for a prompt"),
    "pretrain": ("flowcredit.commands.pretrain", "main", "pretrain the built-in tiny model"),
    "bench": ("flowcredit.commands.bench", "main", "compare credit-assignment methods"),
    "audit": ("flowcredit.commands.audit", "main", "how well each credit rule tracks each step's effect"),
    "demo": ("flowcredit.commands.demo", "main", "the default CPU fine-tuning job (make demo)"),
    "memory": ("flowcredit.commands.memory", "main", "predicted peak GPU memory per phase, without a GPU"),
    "serve-reward": ("flowcredit.rewards.server", "main", "serve a registered reward over HTTP"),
}


def _usage() -> str:
    lines = ["usage: flowcredit COMMAND [options]   (flowcredit COMMAND --help for details)", "", "commands:"]
    lines += [f"  {name:<12} {doc}" for name, (_, _, doc) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"flowcredit: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        result = getattr(importlib.import_module(module), func)(rest)
    except UserError as exc:
        if os.environ.get("FLOWCREDIT_TRACEBACK"):
            raise
        print(f"flowcredit {name}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C: the command has said what it kept; no traceback
        if os.environ.get("FLOWCREDIT_TRACEBACK"):
            raise
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
