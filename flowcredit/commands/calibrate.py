"""``flowcredit calibrate --run_dir DIR [--field value …]``: DenseGRPO's ψ, written to ``DIR/psi.json``
for ``--psi_path`` (and ``DIR/calibration.json`` with every round)."""

from __future__ import annotations

import dataclasses

from flowcredit.cli_args import CONFIG_ORDER, ArgParser, add_config_fields
from flowcredit.presets import PRESETS, load_config

DESCRIPTION = (
    "Calibrate DenseGRPO's per-step noise ψ (Algorithm 1: a trained step's noise grows while the signs of "
    "its step rewards stay balanced, else shrinks) for the model, reward, prompts and steps of a training "
    "config, without training. Writes RUN_DIR/psi.json, for 'flowcredit train --psi_path RUN_DIR/psi.json' "
    "(a grid of runs shares one calibration), and RUN_DIR/calibration.json with every round. The calib_* "
    f"fields set its rounds; --calibrate and --psi_path are set by the command. {CONFIG_ORDER}"
)


def _parser() -> ArgParser:
    p = ArgParser(prog="flowcredit calibrate", description=DESCRIPTION)
    p.add_argument("--preset", default="dense_grpo", help=" | ".join(PRESETS) + " (default dense_grpo)")
    p.add_argument("--config", default=None, help="YAML or JSON file of config fields, over the preset")
    add_config_fields(p, skip=("calibrate", "psi_path"))
    return p


def main(argv: list[str] | None = None) -> int:
    from flowcredit.run.calibrate import ensure_psi
    from flowcredit.run.session import build_session

    args, overrides = _parser().parse_with_overrides(argv)
    cfg = load_config(args.preset, args.config, [*overrides, "--calibrate", "true", "--psi_path", ""])
    s = build_session(dataclasses.replace(cfg, iterations=0))
    ensure_psi(s)
    print(f"wrote {s.run_dir / 'psi.json'}: {[round(x, 4) for x in s.psi.tolist()]}")
    return 0
