"""The newer methods' step plans in the loop (issue 39), each checked against a computation written out
here (the sampler: ``glue_probes``): branch rollouts (TempFlow-GRPO, E-GRPO's merged grid) against the
test's own Euler/Flow-SDE steps and network-call count, a rank's slice of them, MixGRPO's window per
iteration; and the per-step loss weight against the sum of single-step gradients weighted by the
closed-form exploration std.

Sizes: 4 steps σ = 1, .75, .5, .25, 0 (shift 1), 2 groups of 2 rows.
"""

from __future__ import annotations

import pytest
import torch
from glue_probes import (
    GRID,
    MERGE,
    MERGED_GRID,
    assert_grads_close,
    flow_mean,
    flow_std,
    gauss_logp,
    grads_at_optimizer_steps,
    grads_far,
    rollout_of,
    session,
    velocity,
)

import flowcredit.train as loop
from flowcredit.run.plans import sample
from flowcredit.run.rollout import seeded

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
    ``nfe`` equal to the rows the network was actually called on, only at the plan's σ; the plan's σ
    sit at ``grid_index`` in the input grid (E-GRPO: its merged step spans two of its steps)."""
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
    torch.testing.assert_close(torch.tensor(GRID)[plan.grid_index], plan.sigmas)
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

        # after the branch step: Euler steps on the plan's grid (every row, to σ = 0)
        for i in range(min(ks) + 1, m):
            rows = torch.tensor([row for row, (_, j) in enumerate(order) if ks[j] < i])
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
    # TempFlow's std weights on its 3 branch steps; E-GRPO's uniform ones on its merged grid; TempFlow's
    # weights on Flow-GRPO's window (steps 0–2, every row trains each)
    "tempflow_grpo": ("tempflow_grpo", {}, GRID, True),
    "egrpo": ("egrpo", {"step_schedule_options": MERGE}, MERGED_GRID, False),
    "flow_grpo_window": ("flow_grpo", {"step_weight": "tempflow"}, GRID, True),
}


@pytest.mark.parametrize("case", sorted(WEIGHTED))
def test_update_gradient_is_the_weighted_sum_of_single_step_gradients(case, tmp_path):
    """One optimizer step over all branch steps (``steps_per_update`` ≥ K): the accumulated gradient is
    ``(1/K)·Σ_k w_k·g_k``, ``g_k`` the surrogate gradient of step ``k``'s rows alone re-scored on the
    plan's grid (E-GRPO: the merged step σ .75 → .25), and ``w_k`` TempFlow's ``s_k / mean_j s_j``
    with the closed-form exploration std ``s_k = g(σ_k)·√Δt_k`` (E-GRPO: uniform, 1). The same on a
    window plan, where every row trains each of its steps (``g_k``: all rows at step ``k``)."""
    preset, extra, grid, by_std = WEIGHTED[case]
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
