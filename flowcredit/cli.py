"""``flowcredit`` command line: a thin dispatcher to each command's ``main(argv)``.

Modules are imported only when their command runs, so ``flowcredit --help`` is instant.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("flowcredit.train", "main", "GRPO fine-tuning with step-level credit assignment"),
    "calibrate": ("flowcredit.calibrate_cmd", "main", "DenseGRPO exploration-space calibration of ψ"),
    "eval": ("flowcredit.evaluate", "main_eval", "evaluate a checkpoint on ShapeEval prompts"),
    "sample": ("flowcredit.evaluate", "main_sample", "sample images for a prompt"),
    "pretrain": ("flowcredit.pretrain", "main", "pretrain the built-in tiny model"),
    "bench": ("flowcredit.bench", "main", "compare credit-assignment methods"),
    "demo": ("flowcredit.demo", "main", "the default CPU fine-tuning job (make demo)"),
    "serve-reward": ("flowcredit.reward_server", "main", "serve a registered reward over HTTP"),
}


def _usage() -> str:
    lines = ["usage: flowcredit COMMAND [options]   (flowcredit COMMAND --help for details)", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, _, doc) in COMMANDS.items()]
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
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
