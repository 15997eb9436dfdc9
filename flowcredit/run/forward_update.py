"""The update of a forward-process rule (:mod:`flowcredit.updates`: AWM, DiffusionNFT) and its old
policy (docs/training.md, "One iteration", step 4, and docs/algorithms.md, "Update rules").

No stored log-density: the rollout's final latents ``clean (B, …)`` are noised afresh at ``K`` time
draws per sample (the rule's ``times``), and the rule's loss compares the current policy's velocity
there with the flow-matching target and with the old policy's velocity. One micro-batch per
(draw, row chunk), ``steps_per_update`` draws accumulated per optimizer step, exactly as the PPO
update accumulates trained steps. The old policy (``Session.old``, a soft-updated copy of the trainable
weights) moves once per iteration, after the update: ``old ← η·old + (1 − η)·θ`` with ``η`` the rule's
``old_decay`` of the optimizer steps taken so far.

Random draws: the time draws and then the fresh noise, all from the iteration's update generator
(purpose 3), drawn for all rows of all ranks and sliced, so a row's draws do not depend on the split;
a rule with ``group_noise`` (DGPO) draws one noise per group of all ranks and gives it to the group's
rows. A rule that needs ``group`` (DGPO's group sums) gets micro-batches of whole groups: ``batch_size``
rounded up to a multiple of ``group_size`` (each rank holds whole groups, in order).
"""

from __future__ import annotations

import torch

from flowcredit.models.protocol import guidance_at
from flowcredit.run.micro_batches import UpdateStats, micro_batches, param_spread
from flowcredit.run.rollout import seeded
from flowcredit.updates import noised, velocity_kl


def forward_update(s, ro, adv, prompts, group, keep, rows, iteration: int) -> dict:
    """The forward-process update over ``keep``'s rows; ``adv (b,)`` one advantage per row, ``rows``
    the ``(total, lo, hi)`` of this rank's rows.

    Returns the statistics, ``train_rows`` (rows × velocities per row: θ, the old policy, and the
    reference when β > 0; ×K draws) and ``train_passes`` (network calls per velocity). Every velocity of
    the update is taken at ``cfg.train_guidance_scale`` (0: the sampling guidance)."""
    cfg, model, rule = s.cfg, s.model, s.update
    fn_opts, time_opts, _ = rule.split(s.update_opts)
    gen = seeded(cfg.seed, iteration, 3)
    total, lo, hi = rows
    clean = ro.states[:, -1]  # (b, …) the rollout's final latents
    times = rule.times(s.sigmas, total, gen, **time_opts)[:, lo:hi]  # (K, b)
    noise = fresh_noise(rule, gen, len(times), total, clean.shape[1:], cfg.group_size)[:, lo:hi]  # (K, b, …)
    n_rows = int(s.dist.sum_(torch.tensor(float(len(keep)))).item())
    if n_rows == 0:
        return {}
    draws = list(range(len(times)))
    rows_at, counts = dict.fromkeys(draws, keep), dict.fromkeys(draws, n_rows)
    size = cfg.batch_size
    if "group" in rule.needs:  # whole groups per micro-batch
        size = -(-size // cfg.group_size) * cfg.group_size
    stats = UpdateStats(("loss/policy", "loss/kl"))
    with guidance_at(model, cfg.train_guidance_scale or None):  # 0: the sampling guidance
        passes = model.guidance_passes
        for _ in range(cfg.inner_epochs):
            order = torch.randperm(len(draws), generator=gen).tolist()
            for start in range(0, len(order), cfg.steps_per_update):
                window = order[start : start + cfg.steps_per_update]
                cond = model.encode(prompts)  # under grad: the text encoder may train
                for k, r, weight, sync in micro_batches(window, rows_at, size, counts, s.dist.world):
                    point = (clean[r], noise[k, r], times[k, r])
                    with s.dist.accumulating(sync):
                        out = draw_loss(s, point, adv[r], cond, group[r], prompts, weight, fn_opts)
                    if weight:
                        stats.add(out)
                stats.optimizer_step(s)
    s.history["update_steps"] = s.history.get("update_steps", 0) + stats.updates
    out = stats.means()
    out["train_rows"] = len(keep) * len(draws) * rule.calls(cfg.beta)
    out["train_passes"] = passes  # network calls per row at the update's guidance (train_guidance_scale)
    return out | param_spread(s)


def fresh_noise(rule, gen, draws: int, total: int, shape, group_size: int) -> torch.Tensor:
    """``(K, total, …)`` standard normal noise of all ranks' rows; with ``rule.group_noise``, one per
    group of ``group_size`` consecutive rows, repeated over its rows."""
    if not rule.group_noise:
        return torch.randn((draws, total, *shape), generator=gen)
    per_group = torch.randn((draws, -(-total // group_size), *shape), generator=gen)  # (K, G, …)
    return per_group.repeat_interleave(group_size, dim=1)[:, :total]


def draw_loss(s, point, adv, cond, group, prompts, weight: float, fn_opts: dict) -> dict:
    """Backward of ``weight·(L + β·mean KL_v)`` for one micro-batch at ``point = (clean, noise, t)``.

    The old policy's (and the reference's) velocities come first, without gradient: swapping weights in
    after the current policy's forward would invalidate its autograd graph."""
    cfg, model = s.cfg, s.model
    clean, noise, t = point
    x_t = noised(clean, noise, t)  # (b, …)
    with torch.no_grad(), s.old.applied():
        v_old = model.velocity(x_t, t, cond[group])
    v_ref = None
    if cfg.beta > 0 or "ref_velocity" in s.update.needs:
        with torch.no_grad(), s.policy.reference():
            v_ref = model.velocity(x_t, t, model.encode(prompts)[group])
    with s.dist.wrapped_net(model):
        v = model.velocity(x_t, t, cond[group])
    given = dict(v_theta=v, v_old=v_old, v_ref=v_ref, clean=clean, noise=noise, t=t, group=group)
    loss = s.update.fn(**{k: given[k] for k in s.update.inputs()}, adv=adv, **fn_opts)
    kl = velocity_kl(v, v_ref).mean() if cfg.beta > 0 else torch.zeros(())
    s.dist.backward((loss + cfg.beta * kl) * weight)
    return {"loss/policy": loss.detach(), "loss/kl": kl.detach()}


def step_old_policy(s) -> None:
    """After an iteration's update: ``old ← η·old + (1 − η)·θ``, ``η = old_decay(optimizer steps so far)``."""
    if s.old is None:
        return
    _, _, decay_opts = s.update.split(s.update_opts)
    s.old.decay = float(s.update.old_decay(s.history.get("update_steps", 0), **decay_opts))
    s.old.update()
