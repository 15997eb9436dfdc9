"""The newer methods' update rules in the loop (issue 39), each checked against a computation written
out here (the sampler: ``glue_probes``): GRPO-Guard's ratio against the sampler's mean and a re-scoring
through the model; the forward-process update (AWM, DiffusionNFT) against the rule's loss at the draws
reproduced from the iteration's generator; the old policy (its soft update, DiffusionNFT's sampling
with it); and which rules train on groups whose advantages are all zero (issue 53).

Sizes: 4 steps σ = 1, .75, .5, .25, 0 (shift 1), 2 groups of 2 rows (one test: the small run's sizes).
"""

from __future__ import annotations

import inspect
from functools import partial

import pytest
import torch
from glue_probes import (
    GRID,
    assert_grads_close,
    flow_mean,
    flow_std,
    gauss_logp,
    grads_at_optimizer_steps,
    grads_far,
    perturb_old,
    rollout_of,
    session,
    velocity,
    weights,
)
from loop_probes import perturb_lora, record_iteration, small_session

import flowcredit.run.forward_update as fu
import flowcredit.train as loop
from flowcredit.run.rollout import Rollout, seeded
from flowcredit.updates import awm, awm_times, nft, nft_times, normalized_log_ratio, ratio_norm

# --- 3. GRPO-Guard's RatioNorm in the loop -------------------------------------------------------------


def test_ratio_norm_sees_the_rollouts_means_and_rescored_transitions(tmp_path, monkeypatch):
    """The rollout keeps each trained step's mean, equal to the Flow-SDE mean recomputed from the stored
    state and the policy's velocity; with the policy then moved (LoRA B drawn at random), the first
    micro-batch's loss is :func:`flowcredit.updates.ratio_norm` of its rows re-scored through the
    model, against those old means (not the new ones: that would be another number)."""
    s = session("grpo_guard", tmp_path)
    batch, cond, plan, levels, sam = rollout_of(s)
    ro, a, steps = sam.ro, s.cfg.noise_level, torch.nonzero(plan.trained).flatten().tolist()
    assert steps == [0, 1, 2] and ro.means is not None
    old_means = {}
    with torch.no_grad():
        for i in steps:
            x = ro.states[:, i]
            old_means[i] = flow_mean(velocity(s, x, GRID[i], cond[batch.group]), x, GRID[i], GRID[i + 1], a)
            torch.testing.assert_close(ro.means[:, i], old_means[i])

    perturb_lora(s, scale=0.2)
    moved = s.policy.trainable_state()
    first = []
    real = loop.step_loss

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        given = inspect.signature(real).bind(*args, **kwargs).arguments
        first.append((given["r"].clone(), given["i"], out["loss/policy"]))
        return out

    monkeypatch.setattr(loop, "step_loss", spy)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * plan.trained
    loop.ppo_update(s, plan, levels, sam, adv, batch.prompts, torch.arange(4), seeded(s.cfg.seed, 0, 3))
    r, i, loss = first[0]

    s.policy.load_trainable_state(moved)  # the weights of the first micro-batch
    with torch.no_grad():
        x, x_next = ro.states[r, i], ro.states[r, i + 1]
        mean_new = flow_mean(velocity(s, x, GRID[i], cond[batch.group[r]]), x, GRID[i], GRID[i + 1], a)
        std = flow_std(GRID[i], GRID[i + 1], a)
        logp_new = gauss_logp(x_next, mean_new, std)
        std_t = torch.full((len(r),), std)
        want = ratio_norm(logp_new, ro.logp[r, i], mean_new, old_means[i][r], std_t, adv[r, i])
        without = ratio_norm(logp_new, ro.logp[r, i], mean_new, mean_new, std_t, adv[r, i])
    assert loss == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    assert abs(without.item() - want.item()) > 1e-3 * abs(want.item())


def test_ratio_norm_update_raises_the_normalised_log_ratio_of_positive_advantages(tmp_path):
    """One small update (lr 1e-4, one optimizer step): GRPO-Guard's normalised log-ratio ``ℓ`` of each
    trained transition, recomputed after it from the post-update velocity and the stored old mean, is
    on average positive for positive advantages and negative for negative ones."""
    s = session("grpo_guard", tmp_path, lr=1e-4, weight_decay=0.0, steps_per_update=8, group_size=4)
    batch, cond, plan, levels, sam = rollout_of(s)
    ro, a, steps = sam.ro, s.cfg.noise_level, torch.nonzero(plan.trained).flatten().tolist()
    adv_row = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, -0.5, 0.5])
    adv = adv_row[:, None] * plan.trained
    loop.ppo_update(s, plan, levels, sam, adv, batch.prompts, torch.arange(8), seeded(s.cfg.seed, 0, 3))
    ell = torch.zeros(8, len(steps))
    with torch.no_grad():
        for n, i in enumerate(steps):
            x, x_next = ro.states[:, i], ro.states[:, i + 1]
            mean = flow_mean(velocity(s, x, GRID[i], cond[batch.group]), x, GRID[i], GRID[i + 1], a)
            std = flow_std(GRID[i], GRID[i + 1], a)
            logp = gauss_logp(x_next, mean, std)
            ell[:, n] = normalized_log_ratio(logp, ro.logp[:, i], mean, ro.means[:, i], torch.full((8,), std))
    pos, neg = adv_row > 0, adv_row < 0
    assert ell[pos].mean() > 0 > ell[neg].mean(), (ell[pos].mean(), ell[neg].mean())
    gain = adv_row[:, None] * ell
    assert gain.sum() > 0.8 * gain.abs().sum()


def test_ratio_norm_first_ratio_of_an_iteration_is_one(tmp_path):
    """GRPO-Guard through a whole iteration (the small run's sizes, with CFG): the first micro-batch
    re-scores the rollout's transitions exactly (ratio 1: the same policy and geometry, so RatioNorm's
    ℓ is 0 there)."""
    s = small_session("grpo_guard", tmp_path)
    metrics = loop.grpo_iteration(s, 0)
    assert metrics["stats/first_ratio_maxdev"] == 0.0


# --- 4. forward-process updates -----------------------------------------------------------------------

FORWARD = {  # rule: preset, extra config, its loss, its time draws (AWM: 2 strata; DiffusionNFT: 3 of 4 σ)
    "awm": ("awm", {"update_options": '{"time_draws": 2}'}, awm, partial(awm_times, time_draws=2)),
    "nft": ("diffusion_nft", {}, nft, nft_times),
}


def forward_batch(s, it: int):
    """The iteration's batch with made-up final latents (``states[:, -1]``; ``states[:, 0]`` differs)."""
    batch = s.draw(it)
    gen = torch.Generator().manual_seed(7)
    states = torch.randn((len(batch.group), 2, *s.model.latent_shape), generator=gen)
    ro = Rollout(states, torch.zeros(len(batch.group), 1), torch.zeros(len(batch.group), 1))
    return batch, ro, torch.randn(len(batch.group), generator=gen)


@pytest.mark.parametrize("rule", sorted(FORWARD))
def test_forward_update_gradient_is_the_rules_loss_at_the_reproduced_draws(rule, tmp_path):
    """One optimizer step over all time draws: the accumulated gradient is the mean over draws ``k`` of
    the rule's loss gradient on the kept rows, at ``x_t = (1 − t)·clean + t·ε`` with ``t`` from the rule's
    ``times`` and then ``ε ~ N(0, I)`` drawn from ``seeded(seed, it, 3)`` for all rows, ``v_old`` the
    old policy's velocity there (weights swapped in by hand, old ≠ θ), ``v_θ`` the current one's."""
    preset, extra, fn, times_of = FORWARD[rule]
    it = 1
    s = session(preset, tmp_path, steps_per_update=8, **extra)
    old = perturb_old(s)
    batch, ro, adv = forward_batch(s, it)
    keep = torch.tensor([0, 1, 3])  # row 2 is left out
    seen = grads_at_optimizer_steps(s)
    stats = fu.forward_update(s, ro, adv, batch.prompts, batch.group, keep, batch.rows, it)
    assert len(seen) == 1 and stats["stats/optimizer_steps"] == 1

    b, gen = len(batch.group), seeded(s.cfg.seed, it, 3)
    times = times_of(s.sigmas, b, gen)  # (K, b)
    noise = torch.randn((len(times), b, *s.model.latent_shape), generator=gen)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)[batch.group]
    want = rule_grad(s, fn, old, (ro.states[:, -1], times, noise), adv, cond, keep)
    assert_grads_close(seen[0], want)


@pytest.mark.parametrize("rule", sorted(FORWARD))
def test_forward_update_draws_of_a_row_do_not_depend_on_the_rank_split(rule, tmp_path, monkeypatch):
    """The points ``(clean, ε, t)`` of each micro-batch, for the rows ``lo … hi − 1`` updated alone
    (``rows = (total, lo, hi)``), are the one-process call's points of those rows, draw by draw."""
    preset, extra, *_ = FORWARD[rule]
    s = session(preset, tmp_path, **extra)
    batch, ro, adv = forward_batch(s, 0)
    seen: list[tuple] = []

    def record(s_, point, adv_, cond, group, prompts, weight, fn_opts):
        seen.append(point)
        return {"loss/policy": torch.zeros(()), "loss/kl": torch.zeros(())}  # as draw_loss: 0-dim tensors

    monkeypatch.setattr(fu, "draw_loss", record)
    b = len(batch.group)
    fu.forward_update(s, ro, adv, batch.prompts, batch.group, torch.arange(b), (b, 0, b), 0)
    full, seen[:] = list(seen), []
    lo = 2
    part = Rollout(ro.states[lo:], ro.logp[lo:], ro.std[lo:])
    fu.forward_update(s, part, adv[lo:], batch.prompts, batch.group[lo:], torch.arange(b - lo), (b, lo, b), 0)
    assert len(seen) == len(full) >= 2
    for got, want in zip(seen, full):
        for g, w in zip(got, want):
            assert torch.equal(g, w[lo:])
    assert not torch.equal(full[0][1][0], full[0][1][1])  # fresh noise per row


# --- 5. the old policy ----------------------------------------------------------------------------------

OLD_OPTIONS = {
    "awm": '{"time_draws": 2, "old_decay_rate": 0.05, "old_decay_max": 0.45}',
    "diffusion_nft": '{"old_decay_rate": 0.05, "old_decay_max": 0.45}',
}


@pytest.mark.parametrize("preset", sorted(OLD_OPTIONS))
def test_old_policy_is_soft_updated_after_the_iteration(preset, tmp_path):
    """After one iteration (old ≠ θ before it, 3 optimizer steps already on record): ``old ← η·old +
    (1 − η)·θ_after`` with ``η = min(rate·steps, max)`` written out, ``steps`` the recorded optimizer
    steps so far (3 + those of this iteration, counted by a spy)."""
    s = session(preset, tmp_path, steps_per_update=1, update_options=OLD_OPTIONS[preset])
    old_before = perturb_old(s)
    s.history["update_steps"] = 3
    theta_before = [p.detach().clone() for p in s.params]
    real_step, count = s.optimizer.step, [0]

    def step(*args, **kwargs):
        count[0] += 1
        return real_step(*args, **kwargs)

    s.optimizer.step = step
    loop.grpo_iteration(s, 0)
    assert count[0] >= 2 and s.history["update_steps"] == 3 + count[0]
    eta = min(0.05 * (3 + count[0]), 0.45)
    for shadow, o, p in zip(s.old.shadow, old_before, s.params):
        torch.testing.assert_close(shadow, eta * o + (1 - eta) * p.detach(), rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(p0, p.detach()) for p0, p in zip(theta_before, s.params))


def test_diffusion_nft_rolls_out_with_the_old_policy(tmp_path, monkeypatch):
    """DiffusionNFT's rollout (an ODE sampler) equals the test's own Euler rollout with the old weights
    swapped in, and differs from the one with θ (old moved off θ first)."""
    s = session("diffusion_nft", tmp_path)
    old = perturb_old(s)
    theta = [p.detach().clone() for p in s.params]
    seen = {}

    def record(s_, ro, *args):
        seen["ro"] = ro
        return {}

    monkeypatch.setattr(loop, "forward_update", record)
    loop.grpo_iteration(s, 0)
    batch = s.draw(0)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)[batch.group]
        finals = []
        for w in (old, theta):
            with weights(s, w):
                x = batch.x0.float()
                for i in range(4):
                    x = x + (GRID[i + 1] - GRID[i]) * velocity(s, x, GRID[i], cond)
            finals.append(x)
    got = seen["ro"].states[:, -1]
    torch.testing.assert_close(got, finals[0])
    assert (got - finals[1]).abs().max() > 1e-3


# --- 6. groups whose advantages are all zero (issue 53) -------------------------------------------------


def zero_first_group(monkeypatch) -> None:
    """The loop's advantages, set to 0 on normalisation group 0 (rewards that tie), the others' kept."""
    real = loop.advantages

    def tied(s, values, group, *args):
        adv, ok = real(s, values, group, *args)
        return torch.where((group == 0)[:, None], torch.zeros_like(adv), adv), ok

    monkeypatch.setattr(loop, "advantages", tied)


def rule_grad(s, fn, old, point, adv, cond, rows) -> list[torch.Tensor]:
    """The gradient of ``fn`` (a mean over ``rows``) at the time draws ``point = (clean, times, noise)``,
    averaged over the draws, with the old policy's weights ``old`` for ``v_old``."""
    clean, times, noise = point
    out = [torch.zeros_like(p) for p in s.params]
    for k in range(len(times)):
        t, eps, x0, c = times[k, rows], noise[k, rows], clean[rows], cond[rows]
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
        with torch.no_grad(), weights(s, old):
            v_old = velocity(s, x_t, t, c)
        loss = fn(v_theta=velocity(s, x_t, t, c), v_old=v_old, clean=x0, noise=eps, t=t, adv=adv[rows])
        for o, g in zip(out, torch.autograd.grad(loss, s.params)):
            o += g / len(times)
    return out


@pytest.mark.parametrize("rule", sorted(FORWARD))
def test_forward_rules_train_on_groups_whose_advantages_are_all_zero(rule, tmp_path, monkeypatch):
    """θ ≠ the old policy and group 0's advantages all 0 (rows 0, 1): the iteration's gradient is that of
    the rule's loss over all 4 rows, as both authors' codes train (AWM's ``old_beta`` KL, DiffusionNFT's
    ``r = ½`` branches pull θ toward the old policy at A = 0). Rows 0–1 add a gradient of their own,
    and the gradient of rows 2–3 alone (the loop before 2026-12-06: mean over 2 rows) is far from it."""
    preset, extra, fn, times_of = FORWARD[rule]
    it = 1
    s = session(preset, tmp_path, steps_per_update=8, **extra)
    old = perturb_old(s)
    zero_first_group(monkeypatch)
    seen, handed = grads_at_optimizer_steps(s), {}
    real_update = loop.forward_update

    def record(s_, ro, adv, prompts, group, keep, *rest):
        handed.update(clean=ro.states[:, -1].clone(), adv=adv.clone(), group=group.clone(), keep=keep.clone())
        return real_update(s_, ro, adv, prompts, group, keep, *rest)

    monkeypatch.setattr(loop, "forward_update", record)
    loop.grpo_iteration(s, it)
    adv, group = handed["adv"], handed["group"]
    assert group.tolist() == [0, 0, 1, 1] and (adv[:2] == 0).all() and (adv[2:] != 0).all()
    assert handed["keep"].tolist() == [0, 1, 2, 3]

    b = len(group)
    gen = seeded(s.cfg.seed, it, 3)
    times = times_of(s.sigmas, b, gen)  # (K, b)
    point = (handed["clean"], times, torch.randn((len(times), b, *s.model.latent_shape), generator=gen))
    with torch.no_grad():
        cond = s.model.encode(s.draw(it).prompts)[group]
    want = rule_grad(s, fn, old, point, adv, cond, torch.arange(4))
    assert_grads_close(seen[0], want)
    zero_rows = rule_grad(s, fn, old, point, adv, cond, torch.arange(2))  # rows 0–1's own (× ½ in `want`)
    assert max(z.abs().max().item() for z in zero_rows) > 0.05 * max(w.abs().max().item() for w in want)
    assert grads_far(seen[0], rule_grad(s, fn, old, point, adv, cond, torch.arange(2, 4)))


@pytest.mark.parametrize("preset", ["flow_grpo", "grpo_guard"])
def test_clipped_surrogates_drop_groups_whose_advantages_are_all_zero(preset, tmp_path, monkeypatch):
    """``clipped`` and ``ratio_norm`` (A·r = 0 at A = 0): the update gets group 1's rows only."""
    s = session(preset, tmp_path)
    zero_first_group(monkeypatch)
    seen, _ = record_iteration(s, monkeypatch)
    assert seen["group"].tolist() == [0, 0, 1, 1] and seen["keep"].tolist() == [2, 3]
