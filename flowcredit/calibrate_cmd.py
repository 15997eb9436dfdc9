"""``flowcredit calibrate``: DenseGRPO's exploration-space calibration of the per-step noise ψ.

Rollouts of the frozen initial policy with ``dance_sde`` at per-step level ψ, step rewards from
``ode_remaining`` values, then :func:`flowcredit.calibration.update_psi` until every trained ψ_i has
oscillated (or ``calib_max_iters``). ψ starts at Flow-SDE's ``g = a·√(σ/(1 − σ̃))`` with a = 0.7.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from flowcredit.calibration import calibrate
from flowcredit.rollout import rollout, state_values
from flowcredit.sde import SAMPLERS


def flow_sde_g(sigmas: torch.Tensor, a: float = 0.7) -> torch.Tensor:
    """``(N,)`` Flow-SDE diffusion coefficients ``g_i = a·√(σ_i/(1 − σ̃_i))`` (σ̃ = σ_1 at σ = 1)."""
    sig, nxt = sigmas[:-1], sigmas[1:]
    tilde = torch.where(sig >= 1.0, nxt, sig)
    return a * torch.sqrt(sig / (1.0 - tilde))


def calibrate_session(s) -> torch.Tensor:
    """Calibrate ψ with the session's (still untrained) model; returns ψ ``(N,)``."""
    from flowcredit.session import ScoreFn
    from flowcredit.train import noise_levels, seeded

    cfg = s.cfg
    _, trained = noise_levels(cfg, None)
    calls = {"n": 0}

    def sample_step_rewards(psi: torch.Tensor) -> torch.Tensor:
        it = 10_000 + calls["n"]  # generators distinct from training iterations
        calls["n"] += 1
        pick = torch.randint(len(s.train_metas), (cfg.calib_groups,), generator=seeded(cfg.seed, it, 0))
        metas = [s.train_metas[i] for i in pick.tolist()]
        prompts = [m["prompt"] for m in metas]
        rows = torch.arange(cfg.calib_groups).repeat_interleave(cfg.group_size)
        x0 = torch.randn((len(rows), *s.model.latent_shape), generator=seeded(cfg.seed, it, 1))
        levels = torch.where(trained, psi, torch.zeros_like(psi))
        with torch.no_grad(), s.policy.merged():  # ψ comes before training: no logp_old to keep exact
            cond = s.model.encode(prompts)
            ro = rollout(
                s.model,
                cond,
                rows,
                x0,
                s.sigmas,
                levels,
                SAMPLERS["dance_sde"],
                seeded(cfg.seed, it, 2),
                batch_size=cfg.batch_size,
            )
            score = ScoreFn(s.reward, cfg.reward, prompts, metas, rows, skip_bad=False)
            values, _ = state_values(
                s.model, cond, rows, ro, s.sigmas, "dense", trained, "ode_remaining", 1, score, cfg.batch_size
            )
        return torch.nan_to_num(values[:, 1:] - values[:, :-1], nan=0.0)

    def progress(it, psi):
        print(f"calibrate: round {it}: psi = {[round(p, 3) for p in psi[trained].tolist()]}", flush=True)

    psi0 = torch.where(trained, flow_sde_g(s.sigmas), torch.zeros(cfg.num_steps))
    psi0 = torch.where(torch.isfinite(psi0), psi0, torch.full_like(psi0, cfg.calib_eps2))
    res = calibrate(
        sample_step_rewards, psi0, trained, cfg.calib_eps1, cfg.calib_eps2, cfg.calib_max_iters, progress
    )
    print(
        f"calibrate: {'converged' if res.converged else 'stopped at the cap'} after {res.iterations} rounds"
    )
    if s.dist.is_main:
        (Path(cfg.run_dir) / "calibration.json").write_text(
            json.dumps({"psi": res.psi.tolist(), "converged": res.converged, "history": res.history}) + "\n"
        )
    return res.psi


def main(argv: list[str] | None = None) -> int:
    """``flowcredit calibrate --run_dir DIR [--key value …]``: writes DIR/psi.json for ``--psi_path``."""
    from flowcredit.config import load_config
    from flowcredit.session import Session

    p = argparse.ArgumentParser(prog="flowcredit calibrate", description=__doc__)
    p.add_argument("--preset", default="dense_grpo")
    p.add_argument("--config", default=None)
    args, rest = p.parse_known_args(argv)
    cfg = load_config(args.preset, args.config, [*rest, "--calibrate", "true", "--psi_path", ""])
    cfg.iterations = 0
    s = Session.open(cfg, resume=False)
    print(f"wrote {s.run_dir / 'psi.json'}: {[round(x, 4) for x in s.psi.tolist()]}")
    return 0 if math.isfinite(float(s.psi.sum())) else 1
