"""The one GRPO loop for every credit-assignment method (docs/training.md, "One iteration").

prompts → rollout (sampler, per-step noise vector, SDE window) → state values (lock-step
completions, one reward call) → advantages (B, N) → PPO updates over the trained steps (KL to the
reference) → EMA → evaluation with the ODE sampler and fixed noise → checkpoint.

Methods differ only by what they pick from the registries (``SAMPLERS[cfg.sampler]``,
``CREDITS[cfg.credit]``, whose ``needs`` says which values to compute). Deviations from the papers:
1. The update visits trained steps in a random order, one step (all rows) per micro-batch, with the
   rollout's batch geometry, so the first ratio is exactly 1; ``steps_per_update`` steps are
   accumulated per optimizer step (Flow-GRPO accumulates over all timesteps).
2. Groups whose advantages are all zero are dropped before the update when the update rule says a
   row with advantage 0 adds no gradient (``Update.drops_zero_advantage``: the clipped surrogates,
   whose ``A·r`` is 0 there). AWM and DiffusionNFT keep them, as both codes do: once θ ≠
   the old policy, AWM's ``old_beta`` KL and DiffusionNFT's ``r = ½`` term carry a gradient at
   advantage 0, and their loss is a mean over the whole batch. Groups with a bad reward are dropped.
3. Random draws come from generators seeded by ``(seed, iteration, purpose)``: resuming is exact.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict

import torch
from tqdm import tqdm

from flowcredit.config import Config
from flowcredit.losses import approx_kl, clipfrac, kl_to_reference
from flowcredit.models import FlowModel
from flowcredit.rewards import Reward
from flowcredit.rewards.guard import ScoreFn
from flowcredit.run.calibrate import ensure_psi
from flowcredit.run.evaluation import evaluate_policy
from flowcredit.run.forward_update import forward_update, step_old_policy
from flowcredit.run.guard_plot import plot_guard
from flowcredit.run.micro_batches import UpdateStats, micro_batches, param_spread
from flowcredit.run.outputs import export_final, final_artifacts, run_label, start_notes
from flowcredit.run.plans import iteration_plan, levels_of, sample
from flowcredit.run.rollout import needed_states, rollout_keeps, seeded, state_values, uncond_given
from flowcredit.run.runlog import RunLog, plot_curves
from flowcredit.run.session import Session, build_session
from flowcredit.run.stopping import StopRequests
from flowcredit.step_weights import step_weights
from flowcredit.updates import normalized_log_ratio
from flowcredit.validation import weight_options


def grpo_iteration(s: Session, it: int) -> dict:
    """One iteration: plan, rollout, values, advantages, update. Returns its metrics; wall-clock
    seconds per phase go under ``time/`` keys (the trainer writes them to ``timings.jsonl``)."""
    cfg, model, clock = s.cfg, s.model, PhaseClock()
    batch = s.draw(it)  # this rank's whole groups
    plan = iteration_plan(cfg, s.sigmas, it)  # this iteration's grid, SDE steps and trained steps
    levels = levels_of(plan, cfg, s.psi)  # (M,)
    with torch.no_grad():
        cond = model.encode(batch.prompts)
    sde_gen = seeded(cfg.seed, it, 2)  # the same on every rank: rollout keeps this rank's rows
    opts = s.rollout_opts | rollout_keeps(s.credit.needs)  # CoCA: the velocities its similarities reuse
    with clock("rollout"), s.sampling_policy():
        sam = sample(model, cond, batch.group, batch.x0, plan, levels, s.step_fn, sde_gen, batch.rows, **opts)
    ro, group, trained = sam.ro, sam.group, plan.trained  # group (B,): each row's prompt
    score = ScoreFn(s.reward, cfg.reward, batch.prompts, batch.metas, group, cfg.skip_bad_rewards)
    with clock("values"), s.policy.merged():  # values never enter logp_old: merged weights are safe
        needs, _, estimator, substeps = s.value_opts
        values, nfe_values = state_values(
            model, cond, group, ro, plan.sigmas, needs, trained, estimator, substeps, score, cfg.batch_size
        )
    per_rank = cfg.prompts_per_iter // s.dist.world * sam.branches  # normalisation groups on each rank
    adv, ok = advantages(s, values, sam.norm_group, sam.rows, trained, per_rank)  # (B, M), (B,)
    adv = sam.shape_credit(adv)  # a branch's rows train their branch step only; a tree's, its edges' values
    bad_groups = torch.unique(sam.norm_group[~ok])
    live_groups = torch.unique(sam.norm_group[(adv != 0).any(dim=1)])
    trains = torch.isin(sam.norm_group, live_groups) if s.update.drops_zero_advantage else ok  # (B,)
    keep = torch.nonzero(trains, as_tuple=True)[0]
    with clock("update"):
        if s.update.forward:
            adv_row = adv[:, trained.nonzero()[0, 0]]  # (B,) one advantage per sample (flow_grpo)
            stats = forward_update(s, ro, adv_row, batch.prompts, group, keep, sam.rows, it)
        else:
            stats = ppo_update(s, plan, levels, sam, adv, batch.prompts, keep, seeded(cfg.seed, it, 3))
    step_old_policy(s)
    train_rows, reused = stats.pop("train_rows", 0), stats.pop("uncond_reused", 0)
    train_passes = stats.pop("train_passes", s.guidance_passes)  # network calls per trained row
    final = values[ok, -1]
    total = s.dist.sum_(torch.tensor([final.sum().item(), float(len(final))], dtype=torch.float64))
    passes = s.dist.world * s.guidance_passes  # network calls per row over all ranks
    return {
        "reward/mean": (total[0] / total[1]).item() if total[1] else math.nan,
        "reward/std": final.std(unbiased=False).item() if len(final) else math.nan,
        **{
            f"reward/{k}": v[ok].mean().item()
            for k, v in (score.components[0] if score.components else {}).items()  # [0]: the final images
            if len(s.reward.fns) > 1
        },
        "adv/abs_mean": adv[:, trained].abs().mean().item(),
        "stats/zero_std_groups": len(torch.unique(sam.norm_group)) - len(live_groups) - len(bad_groups),
        "stats/bad_reward_groups": len(bad_groups),
        "nfe/rollout": passes * sam.nfe,
        "nfe/values": nfe_values * passes,
        "nfe/train": (train_rows * train_passes * cfg.inner_epochs - reused) * s.dist.world,
        **stats,
        **clock.seconds(reward=score.seconds),
    }


def advantages(s: Session, values, group, rows, trained, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's advantages ``(b, M)`` and its rows outside bad-reward groups ``(b,)``.

    The credit function sees the values of every rank's rows (gathered; a no-op with one process),
    so batch-wide statistics such as ``global_std`` are those of the one-process run. Groups with a
    NaN value where the method needs one are dropped (advantage 0). ``group (b,)``: normalisation
    groups, ``per_rank`` of them on every rank.
    """
    _, lo, hi = rows
    values_all = s.dist.gather_rows(values)  # (B, M + 1)
    group_all = s.dist.gather_rows(group + s.dist.rank * per_rank)  # (B,) global group ids
    bad = torch.isnan(values_all[:, needed_states(s.credit.needs, trained)]).any(dim=1)  # (B,)
    ok = ~torch.isin(group_all, torch.unique(group_all[bad]))
    adv = torch.zeros(len(group_all), trained.numel())  # (B, M)
    if ok.any():
        adv[ok] = s.credit.fn(values_all[ok], group_all[ok], trained, **s.credit_kwargs)
    return adv[lo:hi], ok[lo:hi]


class PhaseClock:
    """Wall-clock seconds per named phase of an iteration: ``with clock("rollout"): …``."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._name, self._t0 = "", 0.0

    def __call__(self, name: str):
        self._name = name
        return self

    def __enter__(self):
        self._t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.totals[self._name] = self.totals.get(self._name, 0.0) + time.perf_counter() - self._t0

    def seconds(self, **extra: float) -> dict:
        return {f"time/{k}_s": v for k, v in {**self.totals, **extra}.items()}


STEP_STATS = ("loss/policy", "loss/kl", "stats/approx_kl", "stats/clipfrac", "stats/ratio_mean")


def ppo_update(s: Session, plan, levels, sam, adv, prompts, keep, gen) -> dict:
    """PPO over the trained steps: one micro-batch per (step, row chunk), accumulated per update."""
    cfg, model = s.cfg, s.model
    steps = torch.nonzero(plan.trained, as_tuple=True)[0]
    rows_at = {int(i): keep[sam.row_trained[keep, i]] for i in steps}  # kept rows that train step i
    std = sam.ro.std.amax(dim=0)  # (M,) the exploration std of each step
    weights = step_weights(cfg.step_weight, plan.sigmas, plan.trained, std, weight_options(cfg))  # (M,)
    stats, reused = UpdateStats(STEP_STATS), 0
    n_rows = {
        i: int(s.dist.sum_(torch.tensor(float(len(r)))).item()) for i, r in rows_at.items()
    }  # all ranks
    if not any(n_rows.values()):
        return {}
    chunks = 0  # FSDP: every pass is a collective, so every rank runs the busiest rank's count
    if s.dist.sharded:
        mine = max(math.ceil(len(r) / cfg.batch_size) for r in rows_at.values())
        chunks = int(s.dist.gather_rows(torch.tensor([mine])).max())
    for _ in range(cfg.inner_epochs):
        order = steps[torch.randperm(len(steps), generator=gen)]
        for start in range(0, len(order), cfg.steps_per_update):
            window = order[start : start + cfg.steps_per_update].tolist()
            cond, cond_step = None, None
            units = micro_batches(window, rows_at, cfg.batch_size, n_rows, s.dist.world, chunks)
            for i, r, weight, sync in units:
                if i != cond_step:  # under grad: the text encoder may train
                    cond, cond_step = model.encode(prompts), i
                uncond = sam.ro.uncond[r, i] if sam.ro.uncond is not None and not stats.updates else None
                reused += len(r) if uncond is not None and weight else 0  # the rollout's own: no pass
                with s.dist.accumulating(sync):
                    out = step_loss(
                        s, plan, levels, sam, adv, prompts, cond, r, i, weight, float(weights[i]), uncond
                    )
                if weight:  # a zero-weight pass (a rank without rows, or FSDP's padding): no statistics
                    stats.add(out)
            stats.optimizer_step(s)
    out = stats.means()
    out["train_rows"] = sum(len(r) for r in rows_at.values()) * (2 if cfg.beta else 1)
    out["uncond_reused"] = reused
    if stats.first is not None:  # before any optimizer step: 1 (exactly at the defaults; docs/training.md)
        out["stats/first_ratio_maxdev"] = stats.first["stats/ratio_maxdev"]
    return out | param_spread(s)


def step_loss(
    s: Session, plan, levels, sam, adv, prompts, cond, r, i: int, weight: float, w_i: float, uncond=None
) -> dict:
    """Backward of ``weight·(w_i·L_pg + β·KL)`` for rows ``r`` at step ``i``; returns the statistics.
    ``uncond``: the rollout's unconditional CFG velocity of these rows (``cfg_uncond_grad`` off,
    before the update's first optimizer step), used instead of running that pass.
    ``L_pg`` is the update rule's loss (``clipped``: Flow-GRPO's surrogate), ``w_i`` the step's loss
    weight (the KL term is not weighted, as in TempFlow-GRPO's and GRPO-Guard's code); the clip
    fraction is the rule's own (GRPO-Guard: of its normalised ratio against its clip range)."""
    cfg, model, ro, group = s.cfg, s.model, sam.ro, sam.group
    x, x_next = ro.states[r, i], ro.states[r, i + 1]
    sigma, sigma_next, level = plan.sigmas[i].item(), plan.sigmas[i + 1].item(), float(levels[i])
    with s.dist.wrapped_net(model), uncond_given(model, uncond):  # DDP's forward (1 process: the net)
        v = model.velocity(x, plan.sigmas[i].expand(len(r)), cond[group[r]])
    step = s.step_fn(v, x, sigma, sigma_next, level, x_next=x_next, logp_mode=cfg.logp_mode)
    logp_old = ro.logp[r, i]
    given = {"logp_new": step.logp, "logp_old": logp_old, "adv": adv[r, i]}
    if "mean" in s.update.needs:
        given |= {"mean_new": step.mean, "mean_old": ro.means[r, i], "std": step.std}
    policy_loss = s.update.fn(**given, **s.update.split(s.update_opts)[0])
    kl = torch.zeros(())
    if cfg.beta > 0:
        with torch.no_grad(), s.policy.reference():
            v_ref = model.velocity(x, plan.sigmas[i].expand(len(r)), model.encode(prompts)[group[r]])
            mean_ref = s.step_fn(
                v_ref, x, sigma, sigma_next, level, x_next=x_next, logp_mode=cfg.logp_mode
            ).mean
        kl = kl_to_reference(step.mean, mean_ref, step.std, sigma_next - sigma, cfg.kl_mode).mean()
    s.dist.backward((w_i * policy_loss + cfg.beta * kl) * weight)
    with torch.no_grad():  # 0-dim tensors, read back once per optimizer step (UpdateStats)
        ratio = torch.exp(step.logp - logp_old)
        return {
            "loss/policy": policy_loss.detach(),
            "loss/kl": kl.detach(),
            "stats/approx_kl": approx_kl(step.logp, logp_old),
            "stats/clipfrac": rule_clipfrac(s, given),
            "stats/ratio_mean": ratio.mean(),
            "stats/ratio_maxdev": (ratio - 1).abs().max(),
        }


def rule_clipfrac(s: Session, given: dict) -> torch.Tensor:
    """The fraction of rows whose ratio the update rule clips: ``clipped``'s ratio against
    ``clip_range``, ``ratio_norm``'s normalised ratio ``exp ℓ`` against its own range."""
    if s.update.clipfrac is not None:  # the rule's own (Flow-DPPO: the rows outside its trust region)
        return s.update.clipfrac(**given, **s.update.split(s.update_opts)[0])
    clip_range = s.update_opts.get("clip_range", s.cfg.clip_range)
    if "mean" not in s.update.needs:
        return clipfrac(given["logp_new"], given["logp_old"], clip_range)
    ell = normalized_log_ratio(**{k: v for k, v in given.items() if k != "adv"})
    return clipfrac(ell, torch.zeros_like(ell), clip_range)


def evaluated(s: Session, log: RunLog | None, iteration: int, tag: str | None) -> dict:
    """``evaluate_policy``'s scores; its image grids go to the tracker if it takes images. ``log`` is
    None off rank 0 (FSDP: every rank evaluates, rank 0 writes)."""
    grids = {} if log is not None and log.wants_images else None
    scores = evaluate_policy(s, tag, grids)
    if log is not None:
        log.log_images(iteration, grids)
    return scores


def end_iteration(s: Session, log: RunLog | None, metrics: dict, done: int, last: bool, t0: float) -> bool:
    """Evaluate (rank 0; FSDP: every rank, its passes are collectives), let the guard act, log (rank 0)
    and save. Returns whether the run ends here (``last``, or the guard stopped it)."""
    cfg = s.cfg
    evaluating = (cfg.eval_every and done % cfg.eval_every == 0) or last
    if (s.dist.is_main or s.dist.sharded) and evaluating:
        metrics.update(evaluated(s, log, done, "after" if last else None))
    if s.guard is not None and evaluating:  # every rank: rank 0's decision is shared
        metrics.update(s.guard.act(s, done))
        last = last or bool(s.guard.stopped)
    if log is not None:
        timings = {k: metrics.pop(k) for k in [k for k in metrics if k.startswith("time/")]}
        log.log(done, metrics, {"time/iteration_s": time.time() - t0, **timings})
    if done % cfg.save_every == 0 or last:
        s.save(done)  # rank 0 writes (FSDP: every rank gathers)
    if cfg.snapshot_every and done % cfg.snapshot_every == 0 and not last:  # final/ holds the last
        export_final(s, s.run_dir / "snapshots" / f"iteration-{done:04d}")
    return last


def train(
    cfg: Config, resume: bool = False, *, model: FlowModel | None = None, reward: Reward | None = None
) -> dict:
    """Run (or resume) training in ``cfg.run_dir``; returns the end-of-run summary (rank 0).

    ``model`` and ``reward`` replace the ones ``cfg`` names (benchmarks and tests inject them). A first
    Ctrl-C stops the run after the iteration in flight, a second one at once (:mod:`flowcredit.run.stopping`).
    """
    s = build_session(cfg, resume, model=model, reward=reward)
    ensure_psi(s)  # DenseGRPO: calibrate ψ with the initial policy before the first iteration
    main = s.dist.is_main  # rank 0 alone evaluates (FSDP: every rank) and writes the run directory
    t_start, resumed_at = time.time(), s.start_iteration if resume else None
    log = RunLog(s.run_dir, resumed_at, cfg.log_with, asdict(cfg)) if main else None  # and the run's clock
    for note in start_notes(cfg) if main else []:
        print(note, flush=True)
    with StopRequests(s.run_dir, announce=main) as stop:
        try:
            done = run_iterations(s, log, stop, t_start)
        finally:
            if log is not None:
                log.close()
        if not (main or s.dist.sharded):
            return {}
        if main:
            plot_curves(s.run_dir)
            if s.guard is not None:
                plot_guard(s.run_dir)
        early = None  # a run cut short is not the run of its settings: the summary says so
        if done < cfg.iterations:
            early = "Ctrl-C" if stop.ctrl_c else f"max_minutes={cfg.max_minutes:g}"
            early = s.guard.stopped if s.guard is not None and s.guard.stopped else early
        elapsed = log.elapsed() if log is not None else time.time() - t_start  # all processes'
        return final_artifacts(s, elapsed, early)  # FSDP: every rank gathers, rank 0 writes


def run_iterations(s: Session, log: RunLog | None, stop: StopRequests, t_start: float) -> int:
    """The start evaluation of a new run, then iterations until the last one or until any rank asks to
    stop (Ctrl-C, ``max_minutes``); returns the number of iterations done. The progress bar ends at
    100 %, or says where the run stopped."""
    cfg, main = s.cfg, s.dist.is_main
    if s.start_iteration == 0:
        scores = evaluated(s, log, 0, "start") if main or s.dist.sharded else {}
        if s.guard is not None:  # the start's signals are the references; best/ starts here
            scores |= s.guard.act(s, 0)
        if main:
            log.log(0, scores)
    label, done = f"train {run_label(cfg)}", s.start_iteration
    bar = tqdm(
        total=cfg.iterations,
        initial=done,
        desc=label,
        dynamic_ncols=True,
        file=sys.stdout,
        disable=not main,
    )
    try:
        for it in range(s.start_iteration, cfg.iterations):
            t0 = time.time()
            metrics = grpo_iteration(s, it)
            done = it + 1
            out_of_time = bool(cfg.max_minutes) and (time.time() - t_start) / 60 >= cfg.max_minutes
            stopping = done == cfg.iterations or stop.ctrl_c or out_of_time
            last = s.dist.sum_(torch.tensor(float(stopping))).item() > 0  # any rank stopping stops all
            last = end_iteration(s, log, metrics, done, last, t0)
            bar.update(1)
            if main:
                bar.set_postfix({"reward": f"{metrics['reward/mean']:.3f}"})
            s.dist.barrier()
            if last:
                break
    finally:
        if done < cfg.iterations:
            bar.set_description(f"{label}: stopped after {done} of {cfg.iterations}")
        bar.close()
    return done
