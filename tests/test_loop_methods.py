"""The loop glue of the newer methods (issue 39), each checked against a computation written out here:
branch rollouts (TempFlow-GRPO, E-GRPO) against the test's own Euler/Flow-SDE steps and network-call
count; the per-step loss weight against the sum of single-step gradients weighted by the closed-form
exploration std; GRPO-Guard's ratio against the sampler's mean and a re-scoring through the model; the
forward-process update (AWM, DiffusionNFT) against the rule's loss at the draws reproduced from the
iteration's generator; and the old policy (its soft update, DiffusionNFT's sampling with it).

Sizes: 4 steps σ = 1, .75, .5, .25, 0 (shift 1), 2 groups of 2 rows. The sampler maths is written out
with the Flow-SDE formulas of docs/algorithms.md §1 (``g = a·√(σ/(1 − σ̃))``, σ̃ = σ' at σ = 1).
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from functools import partial

import pytest
import torch
from loop_probes import perturb_lora, small_session

import flowcredit.run.forward_update as fu
import flowcredit.train as loop
from flowcredit.run.plans import iteration_plan, levels_of, sample
from flowcredit.run.rollout import Rollout, seeded
from flowcredit.updates import awm, awm_times, nft, nft_times, normalized_log_ratio, ratio_norm

SIZE = dict(num_steps=4, prompts_per_iter=2, group_size=2, batch_size=64, beta=0.0, max_grad_norm=1e9)
SIZE["guidance_scale"] = 1.0  # one network pass per call (the glue is the same with CFG's two)
GRID = [1.0, 0.75, 0.5, 0.25, 0.0]  # the tiny model's σ grid at 4 steps
# E-GRPO at horizon 0.75: step 0 alone (entropy 1.06 ≥ 1), steps 1–2 merged into σ .75 → .25 (0.92 < 1 ≤ 1.27)
MERGE, MERGED_GRID = '{"horizon": 0.75}', [1.0, 0.75, 0.25, 0.0]


def session(preset: str, tmp_path, **extra):
    return small_session(preset, tmp_path / "run", **{**SIZE, **extra})


# --- the sampler written out (Flow-SDE, docs/algorithms.md §1) ---------------------------------------


def flow_std(sigma: float, sigma_next: float, a: float) -> float:
    """``g·√(σ − σ')`` with ``g = a·√(σ/(1 − σ̃))``."""
    tilde = sigma_next if sigma >= 1.0 else sigma
    return a * math.sqrt(sigma / (1.0 - tilde)) * math.sqrt(sigma - sigma_next)


def flow_mean(v, x, sigma: float, sigma_next: float, a: float) -> torch.Tensor:
    """``x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]``."""
    tilde = sigma_next if sigma >= 1.0 else sigma
    g2 = a * a * sigma / (1.0 - tilde)
    return x + (sigma_next - sigma) * (v + g2 / (2.0 * sigma) * (x + (1.0 - sigma) * v))


def gauss_logp(x_next, mean, std: float) -> torch.Tensor:
    """``mean_d[−(x' − μ)²/(2s²)] − log s − ½·log 2π``, ``(B,)``."""
    sq = ((x_next - mean) ** 2).flatten(1).mean(1)
    return -sq / (2.0 * std**2) - math.log(std) - 0.5 * math.log(2.0 * math.pi)


def velocity(s, x, sigma, cond_rows) -> torch.Tensor:
    """The policy's velocity at ``x (b, …)``; ``sigma`` a float or ``(b,)``."""
    return s.model.velocity(x, torch.as_tensor(sigma, dtype=torch.float32).expand(len(x)), cond_rows)


def rollout_of(s, it: int = 0):
    """The iteration's batch, its encoding, plan, levels and :func:`sample` (what ``grpo_iteration`` does)."""
    batch = s.draw(it)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)
    plan = iteration_plan(s.cfg, s.sigmas, it)
    levels = levels_of(plan, s.cfg, s.psi)
    args = (s.model, cond, batch.group, batch.x0, plan, levels, s.step_fn, seeded(s.cfg.seed, it, 2))
    sam = sample(*args, batch.rows, **s.rollout_opts)
    return batch, cond, plan, levels, sam


def grads_at_optimizer_steps(s) -> list[list[torch.Tensor]]:
    """Replace ``s.optimizer.step`` by a spy that records every parameter's gradient and does not step."""
    seen: list[list[torch.Tensor]] = []
    s.optimizer.step = lambda *a, **k: seen.append(
        [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in s.params]
    )
    return seen


@contextmanager
def weights(s, values: list[torch.Tensor]):
    """Run with ``values`` copied into the trainable parameters (restored after)."""
    kept = [p.detach().clone() for p in s.params]
    with torch.no_grad():
        for p, v in zip(s.params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(s.params, kept):
                p.copy_(v)


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0, "no gradient at all: nothing is checked"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


def grads_far(got: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    """``other`` differs from ``got`` by far more than :func:`assert_grads_close` tolerates."""
    scale = max(g.abs().max().item() for g in got)
    return max((g - o).abs().max().item() for g, o in zip(got, other)) > 1e-2 * scale


def perturb_old(s, scale: float = 0.05, seed: int = 1) -> list[torch.Tensor]:
    """Move the old policy off θ (every shadow weight plus ``scale``·N(0, 1)); returns its copy."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for shadow in s.old.shadow:
            shadow.add_(scale * torch.randn(shadow.shape, generator=gen))
    return [t.clone() for t in s.old.shadow]


# --- 1. branch rollouts -------------------------------------------------------------------------------

BRANCH_CASES = {
    # preset, extra config, iteration, the plan's grid, its branch (SDE) steps
    "tempflow_all": ("tempflow_grpo", {"step_schedule_options": '{"branches": "all"}'}, 0, GRID, [0, 1, 2]),
    "tempflow_cycle": ("tempflow_grpo", {"step_schedule_options": '{"branches": "cycle"}'}, 1, GRID, [1]),
    "egrpo_merged": ("egrpo", {"step_schedule_options": MERGE}, 0, MERGED_GRID, [0, 1]),
}


@pytest.mark.parametrize("case", sorted(BRANCH_CASES))
def test_branch_rollout_shares_the_ode_trunk_and_explores_one_step_per_branch(case, tmp_path, monkeypatch):
    """Rows ``(r, j)`` row-major, row ``(r, j)`` exploring branch step ``k = ks[j]``: its states
    ``x_0 … x_k`` are an independent Euler rollout of ``x_0`` (the same tensors for every row of the
    group), step ``k`` is a Flow-SDE step (std by the closed form, ``logp`` by re-scoring), every other
    step has std 0 and logp 0, the steps after ``k`` are Euler steps on the plan's grid; ``group``,
    ``norm_group = group·K + j``, one-hot ``row_trained``, ``rows`` and ``nfe`` as documented, and
    ``nfe`` equal to the rows the network was actually called on, only at the plan's σ."""
    preset, extra, it, grid, ks = BRANCH_CASES[case]
    s = session(preset, tmp_path, **extra)
    calls: list[tuple[int, float]] = []  # (rows, σ) of each network call
    real = s.model.velocity

    def counting(x, sigma, cond):
        calls.append((len(x), float(torch.as_tensor(sigma).reshape(-1)[0])))
        return real(x, sigma, cond)

    monkeypatch.setattr(s.model, "velocity", counting)
    batch, cond, plan, _, sam = rollout_of(s, it)
    monkeypatch.setattr(s.model, "velocity", real)
    ro, a = sam.ro, s.cfg.noise_level
    b, p, m, kn = len(batch.group), len(batch.prompts), len(grid) - 1, len(ks)
    torch.testing.assert_close(plan.sigmas, torch.tensor(grid))
    assert torch.nonzero(plan.sde).flatten().tolist() == ks and sam.branches == kn
    assert ro.states.shape[:2] == (b * kn, m + 1) and ro.std.shape == (b * kn, m)

    # rows (r, j) in row-major order, and what each row stands for
    order = [(r, j) for r in range(b) for j in range(kn)]
    assert sam.group.tolist() == [int(batch.group[r]) for r, _ in order]
    assert sam.norm_group.tolist() == [int(batch.group[r]) * kn + j for r, j in order]
    one_hot = torch.zeros(b * kn, m, dtype=torch.bool)
    for row, (_, j) in enumerate(order):
        one_hot[row, ks[j]] = True
    assert torch.equal(sam.row_trained, one_hot)
    total, lo, hi = batch.rows
    assert sam.rows == (total * kn, lo * kn, hi * kn)
    assert sam.nfe == sum(n for n, _ in calls) == p * max(ks) + sum(b * (m - k) for k in ks)
    assert {sigma for _, sigma in calls} <= set(plan.sigmas[:-1].tolist())

    with torch.no_grad():
        # the trunk: an independent Euler rollout of every row's x_0 up to the last branch step
        ode = [batch.x0.float()]
        for i in range(max(ks)):
            ode.append(ode[-1] + (grid[i + 1] - grid[i]) * velocity(s, ode[-1], grid[i], cond[batch.group]))
        for row, (r, j) in enumerate(order):
            k = ks[j]
            torch.testing.assert_close(ro.states[row, : k + 1], torch.stack([x[r] for x in ode[: k + 1]]))
            twin = [q for q, (r2, j2) in enumerate(order) if batch.group[r2] == batch.group[r] and j2 == j]
            assert all(torch.equal(ro.states[q, : k + 1], ro.states[row, : k + 1]) for q in twin)
            want_std = torch.zeros(m)
            want_std[k] = flow_std(grid[k], grid[k + 1], a)
            torch.testing.assert_close(ro.std[row], want_std)
            assert (ro.logp[row][torch.arange(m) != k] == 0).all()

        # the branch step: a Flow-SDE transition, a fresh draw on every row
        for j, k in enumerate(ks):
            rows = torch.arange(j, b * kn, kn)  # the rows (r, j), r = 0 … b − 1
            x, x_next = ro.states[rows, k], ro.states[rows, k + 1]
            mean = flow_mean(velocity(s, x, grid[k], cond[sam.group[rows]]), x, grid[k], grid[k + 1], a)
            std = flow_std(grid[k], grid[k + 1], a)
            torch.testing.assert_close(ro.logp[rows, k], gauss_logp(x_next, mean, std), rtol=1e-5, atol=1e-5)
            z2 = ((x_next - mean) / std).pow(2).flatten(1).mean(1)  # (b,) ≈ 1 for a N(mean, std²) draw
            assert ((z2 > 0.85) & (z2 < 1.15)).all(), z2
            assert not torch.equal(x_next[0], x_next[1])  # rows 0, 1 share a group (and x_0)

        # after the branch step: Euler steps on the plan's grid (a row of each group)
        for i in range(min(ks) + 1, m):
            rows = torch.tensor([row for row, (r, j) in enumerate(order) if ks[j] < i and r in (0, b - 1)])
            x = ro.states[rows, i]
            want = x + (grid[i + 1] - grid[i]) * velocity(s, x, grid[i], cond[sam.group[rows]])
            torch.testing.assert_close(ro.states[rows, i + 1], want)


def test_a_ranks_branch_rows_are_the_one_process_rows(tmp_path):
    """The rows ``(r, k)`` of the second group alone (``rows = (total, lo, hi)``, as on rank 1 of 2)
    are the contiguous slice ``lo·K … hi·K`` of the one-process rollout, noise included."""
    s = session("tempflow_grpo", tmp_path)
    batch, cond, plan, levels, full = rollout_of(s)
    total, kn = len(batch.group), full.branches
    lo = int(torch.nonzero(batch.group == 1)[0, 0])
    with torch.no_grad():
        part = sample(
            s.model, s.model.encode(batch.prompts[1:]), batch.group[lo:] - 1, batch.x0[lo:], plan, levels,
            s.step_fn, seeded(s.cfg.seed, 0, 2), (total, lo, total), **s.rollout_opts,
        )  # fmt: skip
    assert part.rows == (total * kn, lo * kn, total * kn)
    torch.testing.assert_close(part.ro.states, full.ro.states[lo * kn :])
    torch.testing.assert_close(part.ro.logp, full.ro.logp[lo * kn :])


@pytest.mark.parametrize(("it", "window"), [(1, [1, 2]), (2, [2])])
def test_mixgrpo_iteration_explores_and_trains_the_window_of_its_iteration(it, window, tmp_path, monkeypatch):
    """MixGRPO with a window of 2 moving every iteration (bound N − 1 = 3): iteration 1 samples and
    trains steps 1–2, iteration 2 step 2 alone (the window stops at the bound). Through the loop: the
    rollout's std is the Flow-SDE std on the window and 0 elsewhere, the update gets that plan and
    advantages on the window only."""
    options = '{"size": 2, "interval": 1, "skip_last": 1}'
    s = session("mixgrpo", tmp_path, step_schedule_options=options)
    seen = {}

    def record(s_, plan, levels, sam, adv, *args):
        seen.update(plan=plan, levels=levels, sam=sam, adv=adv)
        return {}

    monkeypatch.setattr(loop, "ppo_update", record)
    loop.grpo_iteration(s, it)
    on = torch.zeros(4, dtype=torch.bool)
    on[window] = True
    assert torch.equal(seen["plan"].trained, on) and torch.equal(seen["plan"].sde, on)
    want_std = torch.tensor(
        [flow_std(GRID[i], GRID[i + 1], s.cfg.noise_level) if on[i] else 0.0 for i in range(4)]
    )
    torch.testing.assert_close(seen["sam"].ro.std, want_std.expand(4, 4))
    assert (seen["adv"][:, ~on] == 0).all() and (seen["adv"][:, on] != 0).any()


# --- 2. per-step loss weights in the update ----------------------------------------------------------


def surrogate_gradient(s, ro, group, cond, adv, rows, i: int, sigmas: list[float]) -> list[torch.Tensor]:
    """Gradient of ``−mean_r A·exp(logp_new − logp_old)`` over ``rows`` at step ``i`` alone, re-scored
    through the model with the Flow-SDE written out (the clipped surrogate's gradient inside the clip)."""
    a = s.cfg.noise_level
    x, x_next = ro.states[rows, i], ro.states[rows, i + 1]
    v = velocity(s, x, sigmas[i], cond[group[rows]])
    logp = gauss_logp(
        x_next, flow_mean(v, x, sigmas[i], sigmas[i + 1], a), flow_std(sigmas[i], sigmas[i + 1], a)
    )
    loss = -(adv[rows, i] * torch.exp(logp - ro.logp[rows, i])).mean()
    return list(torch.autograd.grad(loss, s.params))


WEIGHTED = {
    # TempFlow's std weights on its 3 branch steps; E-GRPO's uniform ones on its merged grid
    "tempflow_grpo": ({}, GRID, True),
    "egrpo": ({"step_schedule_options": MERGE}, MERGED_GRID, False),
}


@pytest.mark.parametrize("preset", sorted(WEIGHTED))
def test_update_gradient_is_the_weighted_sum_of_single_step_gradients(preset, tmp_path):
    """One optimizer step over all branch steps (``steps_per_update`` ≥ K): the accumulated gradient is
    ``(1/K)·Σ_k w_k·g_k``, ``g_k`` the surrogate gradient of step ``k``'s rows alone re-scored on the
    plan's grid (E-GRPO: the merged step σ .75 → .25), and ``w_k`` TempFlow's ``s_k / mean_j s_j``
    with the closed-form exploration std ``s_k = g(σ_k)·√Δt_k`` (E-GRPO: uniform, 1)."""
    extra, grid, by_std = WEIGHTED[preset]
    s = session(preset, tmp_path, steps_per_update=8, **extra)
    batch, cond, plan, levels, sam = rollout_of(s)
    ks = torch.nonzero(plan.trained).flatten().tolist()
    adv = torch.randn(sam.row_trained.shape, generator=torch.Generator().manual_seed(5)) * sam.row_trained
    seen = grads_at_optimizer_steps(s)
    keep = torch.arange(len(sam.group))
    loop.ppo_update(s, plan, levels, sam, adv, batch.prompts, keep, seeded(s.cfg.seed, 0, 3))
    assert len(seen) == 1

    w = torch.ones(len(ks))
    if by_std:
        std = torch.tensor([flow_std(grid[k], grid[k + 1], s.cfg.noise_level) for k in ks])
        w = std / std.mean()  # 1.27, 1.10, 0.63
        assert w.max() / w.min() > 1.5
    per_step = [
        surrogate_gradient(s, sam.ro, sam.group, cond, adv, sam.row_trained[:, k], k, grid) for k in ks
    ]
    want = [sum(w[j] * g[n] for j, g in enumerate(per_step)) / len(ks) for n in range(len(s.params))]
    assert_grads_close(seen[0], want)
    if by_std:
        unweighted = [sum(g[n] for g in per_step) / len(ks) for n in range(len(s.params))]
        assert grads_far(seen[0], unweighted)  # the weights are what makes the difference


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

    b, clean = len(batch.group), ro.states[keep, -1]
    gen = seeded(s.cfg.seed, it, 3)
    times = times_of(s.sigmas, b, gen)  # (K, b)
    noise = torch.randn((len(times), b, *s.model.latent_shape), generator=gen)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)[batch.group[keep]]
    want = [torch.zeros_like(p) for p in s.params]
    for k in range(len(times)):
        t, eps = times[k, keep], noise[k, keep]
        x_t = (1 - t.view(-1, 1, 1, 1)) * clean + t.view(-1, 1, 1, 1) * eps
        with torch.no_grad(), weights(s, old):
            v_old = velocity(s, x_t, t, cond)
        loss = fn(v_theta=velocity(s, x_t, t, cond), v_old=v_old, clean=clean, noise=eps, t=t, adv=adv[keep])
        for w, g in zip(want, torch.autograd.grad(loss, s.params)):
            w += g / len(times)
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
        return {"loss/policy": 0.0, "loss/kl": 0.0}

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
