"""The loop glue of the newer methods, each against an independent computation: branch rollouts
(TempFlow-GRPO, E-GRPO) against a plain ODE rollout, per-step loss weights against per-step gradients
and the sampler's std, GRPO-Guard's stored means against the sampler's, the forward-process update
(AWM, DiffusionNFT) against its loss at the same draws, and the old policy's soft update."""

from __future__ import annotations

import pytest
import torch
from loop_probes import record_iteration, small_session

import flowcredit.run.forward_update as fwd
from flowcredit.run.plans import iteration_plan, levels_of, sample
from flowcredit.run.rollout import rollout, seeded
from flowcredit.step_schedules import flow_sde_std
from flowcredit.train import grpo_iteration, ppo_update
from flowcredit.updates import UPDATES, soft_update_decay


def _sampled(s, it=0):
    batch = s.draw(it)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)
    plan = iteration_plan(s.cfg, s.sigmas, it)
    levels = levels_of(plan, s.cfg, s.psi)
    gen = seeded(s.cfg.seed, it, 2)
    sam = sample(
        s.model, cond, batch.group, batch.x0, plan, levels, s.step_fn, gen, batch.rows, **s.rollout_opts
    )
    return batch, cond, plan, levels, sam


@pytest.mark.parametrize("branches", ["all", "cycle"])
def test_branch_rows_follow_the_ode_to_their_step_explore_once_then_follow_the_ode(branches, tmp_path):
    """Rows (r, k), row-major: x_0 … x_k of every branch equal an ODE rollout of x_0; step k alone has
    noise; from x_{k+1} on the branch is the ODE again; normalisation groups are (group, k); the network
    calls are one trunk per group plus B·(M − k) per branch."""
    opts = f'{{"branches": "{branches}"}}'
    s = small_session(
        "flow_grpo", tmp_path, step_schedule="tempflow", step_schedule_options=opts, shared_noise=True
    )
    batch, cond, plan, levels, sam = _sampled(s, it=1)
    ks = plan.sde.nonzero()[:, 0].tolist()
    b, n_k, m = len(batch.group), len(ks), plan.sde.numel()
    assert (n_k, sam.branches) == ((m - 1, m - 1) if branches == "all" else (1, 1))
    assert torch.equal(sam.group, batch.group.repeat_interleave(n_k))
    assert torch.equal(sam.norm_group, (batch.group[:, None] * n_k + torch.arange(n_k)).reshape(-1))
    ode = rollout(
        s.model, cond, batch.group, batch.x0, plan.sigmas, torch.zeros(m), s.step_fn, torch.Generator()
    )
    states = sam.ro.states.view(b, n_k, m + 1, *sam.ro.states.shape[2:])
    std = sam.ro.std.view(b, n_k, m)
    for j, k in enumerate(ks):
        torch.testing.assert_close(states[:, j, : k + 1], ode.states[:, : k + 1], rtol=0, atol=1e-5)
        others = torch.ones(m, dtype=torch.bool)
        others[k] = False
        assert bool((std[:, j, k] > 0).all()) and bool((std[:, j, others] == 0).all())
        assert torch.equal(
            sam.row_trained.view(b, n_k, m)[:, j],
            torch.nn.functional.one_hot(torch.tensor(k), m).bool().expand(b, m),
        )
        rest = rollout(
            s.model,
            cond,
            batch.group,
            states[:, j, k + 1],
            plan.sigmas[k + 1 :],
            torch.zeros(m - k - 1),
            s.step_fn,
            torch.Generator(),
        )
        torch.testing.assert_close(states[:, j, -1], rest.states[:, -1], rtol=0, atol=1e-5)
        assert not torch.equal(states[0, j, k + 1], states[1, j, k + 1])  # each row draws its own noise
    groups = len(torch.unique(batch.group))
    assert sam.nfe == groups * max(ks) + sum(b * (m - k) for k in ks)


def test_merged_plan_rolls_out_on_its_own_grid(tmp_path):
    """E-GRPO: the rollout follows the plan's merged grid (M < N steps), its merged SDE step sized by the
    merged σ's."""
    s = small_session(
        "egrpo", tmp_path, num_steps=8, step_schedule_options='{"threshold": 0.5, "horizon": 0.75}'
    )
    _, _, plan, levels, sam = _sampled(s)
    m = plan.sde.numel()
    assert m < s.cfg.num_steps and sam.ro.states.shape[1] == m + 1
    merged = [int(i) for i in plan.sde.nonzero()[:, 0] if plan.grid_index[i + 1] - plan.grid_index[i] > 1]
    assert merged, plan.grid_index
    want = flow_sde_std(plan.sigmas[merged[0]], plan.sigmas[merged[0] + 1], s.cfg.noise_level)
    assert float(sam.ro.std.amax(0)[merged[0]]) == pytest.approx(float(want), rel=1e-5)


def _grads_of_one_update(s, fn):
    """The accumulated gradient when ``fn()`` runs an update with a single optimizer step (not taken)."""
    grads = []
    s.optimizer.step = lambda *a, **k: grads.append([p.grad.clone() for p in s.params])
    fn()
    (one,) = grads
    return one


def test_step_weights_scale_each_steps_gradient_by_the_closed_form(tmp_path):
    """With TempFlow-GRPO's weights, one optimizer step's gradient is Σ_i w_i·g_i / W (W trained steps,
    g_i the gradient of step i alone), w_i = s_i / mean_j s_j with Flow-SDE's std s_i = g·√Δt_i."""
    s = small_session("flow_grpo", tmp_path, step_weight="tempflow", steps_per_update=10, max_grad_norm=1e9)
    batch, _, plan, levels, sam = _sampled(s)
    adv = torch.randn(len(batch.group), plan.sde.numel(), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(len(batch.group))
    whole = _grads_of_one_update(
        s, lambda: ppo_update(s, plan, levels, sam, adv, batch.prompts, keep, seeded(0, 0, 3))
    )
    steps = plan.trained.nonzero()[:, 0].tolist()
    std = torch.stack([flow_sde_std(s.sigmas[i], s.sigmas[i + 1], s.cfg.noise_level) for i in steps])
    w = std / std.mean()
    s.cfg.step_weight = "uniform"
    want = [torch.zeros_like(g) for g in whole]
    for wi, i in zip(w.tolist(), steps):
        only = torch.zeros_like(sam.row_trained)
        only[:, i] = True
        one = type(plan)(plan.sigmas, plan.sde, only[0].clone(), plan.grid_index)
        sam_i = type(sam)(sam.ro, sam.group, sam.norm_group, only, sam.rows, sam.nfe)
        g = _grads_of_one_update(
            s,
            lambda one=one, sam_i=sam_i: ppo_update(
                s, one, levels, sam_i, adv, batch.prompts, keep, seeded(0, 0, 3)
            ),
        )
        want = [acc + wi * gi / len(steps) for acc, gi in zip(want, g)]
    scale = max(float(g.abs().max()) for g in whole)
    for got, exp in zip(whole, want):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5 * scale)


def test_ratio_norm_sees_the_samplers_mean_and_a_unit_first_ratio(tmp_path, monkeypatch):
    """GRPO-Guard: the rollout's stored means are the sampler's mean at each stored state under the
    sampling policy, and the first micro-batch re-scores them exactly (ratio 1: the same policy and
    geometry, so RatioNorm's ℓ is 0 there)."""
    s = small_session("grpo_guard", tmp_path)
    seen, metrics = record_iteration(s, monkeypatch)
    ro = seen["ro"]
    s.policy.load_trainable_state(seen["policy_before_update"])
    cond = s.model.encode(seen["prompts"])
    for i in seen["plan"].trained.nonzero()[:, 0].tolist()[:2]:
        with torch.no_grad():
            v = s.model.velocity(ro.states[:, i], s.sigmas[i].expand(len(ro.states)), cond[seen["group"]])
        x, x_next, level = ro.states[:, i], ro.states[:, i + 1], float(seen["levels"][i])
        step = s.step_fn(v, x, s.sigmas[i].item(), s.sigmas[i + 1].item(), level, x_next=x_next)
        torch.testing.assert_close(ro.means[:, i], step.mean.float(), rtol=0, atol=1e-5)
    assert metrics["stats/first_ratio_maxdev"] == 0.0


@pytest.mark.parametrize("rule", ["awm", "nft"])
def test_forward_update_is_the_rules_loss_at_the_drawn_points(rule, tmp_path, monkeypatch):
    """One optimizer step over all K draws: the gradient is (1/K)·Σ_k ∇L(v_θ(x_t), v_old, clean, ε_k, t_k)
    at x_t = (1 − t)·clean + t·ε with t, ε reproduced from the update's generator (times, then noise,
    for all rows); the old policy is the starting weights."""
    s = small_session(
        "awm" if rule == "awm" else "diffusion_nft",
        tmp_path,
        steps_per_update=50,
        max_grad_norm=1e9,
        beta=0.0,
    )
    batch, _, plan, levels, sam = _sampled(s)
    b = len(batch.group)
    adv = torch.linspace(-2, 2, b)
    keep = torch.arange(b)
    got = _grads_of_one_update(
        s, lambda: fwd.forward_update(s, sam.ro, adv, batch.prompts, batch.group, keep, (b, 0, b), 0)
    )
    entry = UPDATES[rule]
    fn_opts, time_opts, _ = entry.split(s.update_opts)
    gen = seeded(s.cfg.seed, 0, 3)
    times = entry.times(s.sigmas, b, gen, **time_opts)
    clean = sam.ro.states[:, -1]
    noise = torch.randn((len(times), *clean.shape), generator=gen)
    s.optimizer.zero_grad(set_to_none=True)
    cond = s.model.encode(batch.prompts)
    total = 0.0
    for k in range(len(times)):
        t = times[k]
        x_t = (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * noise[k]
        v = s.model.velocity(x_t, t, cond[batch.group])
        total = total + entry.fn(
            v_theta=v, v_old=v.detach(), clean=clean, noise=noise[k], t=t, adv=adv, **fn_opts
        )
    (total / len(times)).backward()
    for p, g in zip(s.params, got):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-8)


def test_forward_draws_of_a_row_do_not_depend_on_the_rank_split(tmp_path, monkeypatch):
    """The rows lo … hi − 1 of a rank get the times and noise they get in the one-process update."""
    s = small_session("awm", tmp_path)
    batch, _, _, _, sam = _sampled(s)
    b = len(batch.group)
    seen = []
    monkeypatch.setattr(
        fwd,
        "noised",
        lambda clean, noise, t: seen.append((noise, t))
        or (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * noise,
    )
    s.optimizer.step = lambda *a, **k: None
    adv = torch.ones(b)
    fwd.forward_update(s, sam.ro, adv, batch.prompts, batch.group, torch.arange(b), (b, 0, b), 0)
    whole = list(seen)
    seen.clear()
    half = b // 2
    rows = torch.arange(half, b)
    fwd.forward_update(
        s,
        _rows(sam.ro, rows),
        adv[rows],
        batch.prompts,
        batch.group[rows],
        torch.arange(b - half),
        (b, half, b),
        0,
    )
    assert len(seen) == len(whole)  # the same draws in the same order (one generator)
    for (noise, t), (noise_all, t_all) in zip(seen, whole):
        assert torch.equal(t, t_all[half:]) and torch.equal(noise, noise_all[half:])


def _rows(ro, rows):
    return type(ro)(ro.states[rows], ro.logp[rows], ro.std[rows])


@pytest.mark.parametrize("preset", ["awm", "diffusion_nft"])
def test_old_policy_moves_once_per_iteration_by_its_decay(preset, tmp_path):
    """After an iteration: old ← η·old + (1 − η)·θ with η = soft_update_decay(optimizer steps so far)
    (here at rate 0.1 per optimizer step, so that η > 0 from the first iteration)."""
    s = small_session(preset, tmp_path, update_options='{"old_decay_rate": 0.1}')
    for it in range(2):
        before = [x.clone() for x in s.old.shadow]
        grpo_iteration(s, it)
        opts = s.update.split(s.update_opts)[2]
        eta = soft_update_decay(s.history["update_steps"], **opts)
        assert 0 < eta < 1
        for shadow, old, p in zip(s.old.shadow, before, s.params):
            torch.testing.assert_close(shadow, eta * old + (1 - eta) * p.detach(), rtol=1e-6, atol=1e-7)


def test_diffusion_nft_samples_with_the_old_policy(tmp_path):
    """Once θ has moved away from the old policy, NFT's rollout is the old policy's, not θ's."""
    s = small_session(
        "diffusion_nft",
        tmp_path,
        sampler="flow_sde",
        update_options='{"old_decay_max": 0.9, "old_decay_rate": 1.0}',
    )
    grpo_iteration(s, 0)
    grpo_iteration(s, 1)  # η = 0.9 now: old ≠ θ
    assert any(not torch.equal(o, p) for o, p in zip(s.old.shadow, s.params))
    _, _, _, _, theirs = _sampled_in(s, s.sampling_policy())
    with s.old.applied():
        _, _, _, _, old = _sampled(s)
    _, _, _, _, mine = _sampled(s)
    assert torch.equal(theirs.ro.states, old.ro.states) and not torch.equal(theirs.ro.states, mine.ro.states)


def _sampled_in(s, context):
    with context:
        return _sampled(s)
