"""DenseGRPO's exploration-space calibration of the per-step noise ψ, run on a session's model.

Rollouts of the frozen initial policy with ``dance_sde`` at per-step level ψ, step rewards from
``ode_remaining`` values, then :func:`flowcredit.calibration.calibrate` (Algorithm 1) until every
trained ψ_i's update has changed direction ``calib_flips`` times or ``calib_max_iters`` rounds have
run. ψ starts at Flow-SDE's ``g = a·√(σ/(1 − σ̃))`` with a = 0.7 (:func:`flowcredit.sde.flow_sde_g`).
docs/algorithms.md §7 has the rule, the tie rule, the stopping rule and the step size.
"""

from __future__ import annotations

import json
import sys

import torch
from tqdm import tqdm

from flowcredit.advantages import step_rewards
from flowcredit.calibration import calibrate, sign_counts
from flowcredit.errors import UserError
from flowcredit.rewards.guard import ScoreFn
from flowcredit.run.progress import progress_bar
from flowcredit.run.psi_file import write_psi
from flowcredit.run.rollout import draw_batch, noise_levels, rollout, seeded, state_values
from flowcredit.run.session import Session
from flowcredit.sde import SAMPLERS, flow_sde_g

CALIBRATION_ITERATIONS = 10_000
"""Calibration round k draws with the generators of iteration ``10_000 + k`` (distinct from training)."""


def start_psi(sigmas: torch.Tensor, trained: torch.Tensor, a: float = 0.7) -> torch.Tensor:
    """``(N,)``: Flow-SDE's ``g`` on the trained steps, 0 elsewhere. Raises if it is not finite there."""
    g = flow_sde_g(sigmas[:-1], sigmas[1:], a)
    bad = trained & ~torch.isfinite(g)
    if bad.any():
        steps = torch.nonzero(bad, as_tuple=True)[0].tolist()
        raise UserError(
            f"calibration: Flow-SDE's g, ψ's start, is not finite at steps {steps} of this schedule "
            "(σ = 1 on two steps?); move the window (window_start) or change the schedule (shift)"
        )
    return torch.where(trained, g, torch.zeros_like(g))


def ensure_psi(s: Session) -> None:
    """Calibrate ψ if the run asks for it (``calibrate``) and has none yet (not restored, not from
    ``psi_path``); then write ``psi.json``. Must run before the first training iteration."""
    if s.psi is None and s.cfg.calibrate:
        s.psi = calibrate_psi(s)
        write_psi(s)


def calibrate_psi(s: Session) -> torch.Tensor:
    """Calibrate ψ with the session's (still untrained) model; writes ``calibration.json`` (rank 0:
    ψ, convergence, flips per step, and every round's ψ and P, Q, ties, tie fraction) and returns
    ψ ``(N,)``."""
    cfg = s.cfg
    rounds = {"n": 0}
    last = {}

    def sample_step_rewards(psi: torch.Tensor) -> torch.Tensor:
        it = CALIBRATION_ITERATIONS + rounds["n"]
        rounds["n"] += 1
        batch = draw_batch(
            s.train_metas, cfg.calib_groups, cfg.group_size, tuple(s.model.latent_shape), False, cfg.seed, it
        )
        levels, _ = noise_levels(cfg, psi)
        with torch.no_grad(), s.policy.merged():  # ψ comes before training: no logp_old to keep exact
            cond = s.model.encode(batch.prompts)
            ro = rollout(
                s.model,
                cond,
                batch.group,
                batch.x0,
                s.sigmas,
                levels,
                SAMPLERS["dance_sde"],
                seeded(cfg.seed, it, 2),
                batch_size=cfg.batch_size,
            )
            score = ScoreFn(s.reward, cfg.reward, batch.prompts, batch.metas, batch.group, skip_bad=False)
            values, _ = state_values(
                s.model,
                cond,
                batch.group,
                ro,
                s.sigmas,
                "states",
                s.trained,
                "ode_remaining",
                1,
                score,
                cfg.batch_size,
            )
        d = step_rewards(values)  # (B, N): NaN off the window, where no value was needed
        last["d"] = torch.where(s.trained, d, torch.zeros_like(d))
        return last["d"]

    def progress(it, psi):
        c = sign_counts(last["d"], s.trained)  # the d this round's update decided on
        steps = torch.nonzero(s.trained, as_tuple=True)[0].tolist()
        cells = [f"{i} {psi[i].item():.3f} {c['pos'][i]}/{c['neg'][i]}/{c['ties'][i]}" for i in steps]
        tqdm.write(f"calibrate: round {it}: step, new psi, P/Q/ties: {' | '.join(cells)}", file=sys.stdout)
        sys.stdout.flush()
        bar.update(1)

    # a bar over the rounds up to the cap; convergence ends it early, at 100 % of the rounds run
    with progress_bar(cfg.calib_max_iters, "calibrate psi", "round", enabled=s.dist.is_main) as bar:
        res = calibrate(
            sample_step_rewards,
            start_psi(s.sigmas, s.trained),
            s.trained,
            cfg.calib_eps1,
            cfg.calib_eps2,
            cfg.calib_max_iters,
            progress,
            min_flips=cfg.calib_flips,
        )
        bar.total = bar.n
    print(
        f"calibrate: {'converged' if res.converged else 'stopped at the cap'} after {res.iterations} rounds"
    )
    if s.dist.is_main:
        (s.run_dir / "calibration.json").write_text(
            json.dumps(
                {
                    "psi": res.psi.tolist(),
                    "converged": res.converged,
                    "iterations": res.iterations,
                    "min_flips": cfg.calib_flips,
                    "flips": res.flips,
                    "history": res.history,
                    "counts": res.counts,
                }
            )
            + "\n"
        )
    return res.psi
