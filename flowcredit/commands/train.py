"""``flowcredit train``: a preset, a YAML file and ``--field value`` overrides, then
``flowcredit.train.train``."""

from __future__ import annotations

from pathlib import Path

from flowcredit.cli_args import CONFIG_ORDER, ArgParser, add_config_fields
from flowcredit.config import Config, from_dict, read_mapping
from flowcredit.errors import UserError
from flowcredit.presets import PRESETS, load_config
from flowcredit.validation import apply_overrides


def _parser() -> ArgParser:
    p = ArgParser(
        prog="flowcredit train",
        description=f"GRPO fine-tuning with step-level credit assignment. {CONFIG_ORDER}",
    )
    p.add_argument("--preset", default="flow_grpo", help=" | ".join(PRESETS))
    p.add_argument("--config", default=None, help="YAML or JSON file of config fields, over the preset")
    p.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    add_config_fields(p)
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

    args, overrides = _parser().parse_with_overrides(argv)
    if args.resume:
        train(resume_config(args.resume, overrides), resume=True)
    else:
        train(load_config(args.preset, args.config, overrides))
    return 0
