"""DenseGRPO's calibrated noise ψ on disk: ``psi.json`` (``{"psi": [ψ_0, …, ψ_{N−1}]}``), written by a run
or ``flowcredit calibrate`` and read back through the config field ``psi_path``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flowcredit.errors import UserError


def read_psi(path: str, num_steps: int) -> torch.Tensor:
    """ψ ``(N,)`` from a ``psi.json`` written by ``flowcredit calibrate`` (or by a run)."""
    try:
        psi = json.loads(Path(path).read_text())["psi"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"config field 'psi_path': cannot read ψ from {path!r} ({exc})") from None
    if not isinstance(psi, list) or len(psi) != num_steps:
        raise UserError(
            f"config field 'psi_path': {path!r} must hold 'psi', a list of num_steps = {num_steps} values"
        )
    return torch.tensor(psi, dtype=torch.float32)


def write_psi(s) -> None:
    """``run_dir/psi.json`` (rank 0): the ψ this run trains with, reusable as ``psi_path``."""
    if s.dist.is_main:
        (s.run_dir / "psi.json").write_text(json.dumps({"psi": s.psi.tolist()}) + "\n")
