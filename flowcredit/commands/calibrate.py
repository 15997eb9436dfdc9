"""``flowcredit calibrate --run_dir DIR [--key value …]``: DenseGRPO's ψ, written to ``DIR/psi.json``
for ``--psi_path`` (and ``DIR/calibration.json`` with every round)."""

from __future__ import annotations

import argparse
import dataclasses

from flowcredit.presets import load_config


def main(argv: list[str] | None = None) -> int:
    from flowcredit.run.calibrate import ensure_psi
    from flowcredit.run.session import build_session

    p = argparse.ArgumentParser(prog="flowcredit calibrate", description=__doc__)
    p.add_argument("--preset", default="dense_grpo")
    p.add_argument("--config", default=None)
    args, rest = p.parse_known_args(argv)
    cfg = load_config(args.preset, args.config, [*rest, "--calibrate", "true", "--psi_path", ""])
    s = build_session(dataclasses.replace(cfg, iterations=0))
    ensure_psi(s)
    print(f"wrote {s.run_dir / 'psi.json'}: {[round(x, 4) for x in s.psi.tolist()]}")
    return 0
