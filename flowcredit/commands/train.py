"""``flowcredit train``: a preset, a YAML file and ``--field value`` overrides, then
``flowcredit.train.train``."""

from __future__ import annotations

import argparse
from pathlib import Path

from flowcredit.config import Config, from_dict, read_mapping
from flowcredit.errors import UserError
from flowcredit.presets import PRESETS, load_config
from flowcredit.validation import apply_overrides


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowcredit train",
        description="GRPO with step-level credit assignment. "
        "Any config field can be given as --field value (see flowcredit/config.py).",
    )
    p.add_argument("--preset", default="flow_grpo", help=" | ".join(PRESETS))
    p.add_argument("--config", default=None, help="YAML file of config fields")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    return p


def resume_config(run_dir: str, overrides: list[str]) -> Config:
    """The config saved in ``run_dir/config.json`` with ``overrides`` applied."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise UserError(f"--resume {run_dir!r}: no config.json in that directory (not a run directory?)")
    cfg = apply_overrides(from_dict(read_mapping("--resume", path), Config()), overrides)
    cfg.run_dir = run_dir
    return cfg


def main(argv: list[str] | None = None) -> int:
    from flowcredit.train import train

    args, rest = _parser().parse_known_args(argv)
    if args.resume:
        train(resume_config(args.resume, rest), resume=True)
    else:
        train(load_config(args.preset, args.config, rest))
    return 0
