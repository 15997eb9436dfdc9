"""G²RPO (:mod:`flowcredit.granular`, :mod:`flowcredit.run.granular_plans`): the completion grids and
their network calls by hand, the integration against hand-computed tensors and an independent
computation of the authors' rule, the rollout against Euler written out, and the edge cases."""

from __future__ import annotations

import pytest
import torch
from glue_probes import GRID, rollout_of, session, velocity

from flowcredit.advantages import CREDITS
from flowcredit.commands.bench_skill import rollout_calls
from flowcredit.granular import (
    completion_grid,
    completion_positions,
    granular_calls,
    granular_credit,
    integrate_granular,
)
from flowcredit.run.plans import branch_sample
from flowcredit.step_plan import GranularShape, StepPlan
from flowcredit.step_schedules import make_plan

S10 = torch.linspace(1.0, 0.0, 11)  # σ_i = 1 − i/10


def _g2rpo_plan(sigmas, **options):
    return make_plan("g2rpo", sigmas, level=0.7, iteration=0, total=1, generator=None, options=options)


@pytest.mark.parametrize(
    ("k", "width", "want"),
    [
        (0, 1, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]),  # the plan's own grid from σ_1
        (0, 2, [0.9, 0.8, 0.6, 0.4, 0.2, 0.0]),  # σ_1, then σ[2::2] = σ_2 σ_4 σ_6 σ_8 σ_10
        (0, 3, [0.9, 0.8, 0.5, 0.0]),  # σ[2::3] = σ_2 σ_5 σ_8: σ_8 replaced by 0 (x − σ_5·v)
        (3, 2, [0.6, 0.5, 0.3, 0.0]),  # σ[5::2] = σ_5 σ_7 σ_9: σ_9 replaced by 0
        (7, 2, [0.2, 0.0]),  # σ[9::2] = σ_9 alone: one jump from σ_8 to 0
        (8, 5, [0.1, 0.0]),  # the last possible step
    ],
)
def test_completion_grid_is_the_prefix_then_every_wth_sigma_ending_at_zero(k, width, want):
    torch.testing.assert_close(completion_grid(S10, k, width), torch.tensor(want), atol=1e-6, rtol=0)


def test_completion_grid_rejects_the_last_step():
    """After step M − 1 there is no σ to subsample (the code's loop would return nothing)."""
    with pytest.raises(ValueError, match="M - 2"):
        completion_grid(S10, 9, 2)


def test_completion_positions_hold_the_latest_state():
    """k = 0, w = 3 on 10 steps: states x_1 … x_10 stand for the completion's c_0 (x_1), c_1 (x_2, …,
    x_4), c_2 (x_5 … x_9; σ_8 is not computed) and c_3 (the clean prediction)."""
    assert completion_positions(10, 0, 3).tolist() == [0, 1, 1, 1, 2, 2, 2, 2, 2, 3]
    assert completion_positions(10, 0, 1).tolist() == list(range(10))
    assert completion_positions(10, 7, 2).tolist() == [0, 0, 1]


def test_granular_calls_by_hand():
    """Steps 0–4 of 10, widths (1, 2): width 1 costs nothing extra; width 2 costs L − 1 per step:
    k = 0: 5, k = 1: 4, k = 2: 4, k = 3: 3, k = 4: 3."""
    assert granular_calls(S10, [0, 1, 2, 3, 4], (1, 2)) == 5 + 4 + 4 + 3 + 3
    assert granular_calls(S10, [0, 1, 2, 3, 4], (1,)) == 0
    assert granular_calls(S10, [0], (1, 2, 3)) == 5 + 3


def test_integrate_granular_by_hand():
    z = torch.tensor([[1.0, 2.0], [-3.0, -4.0], [4.0, 4.0]])  # (3, G = 2)
    torch.testing.assert_close(integrate_granular(z), torch.tensor([3.0, -5.0, 5.0]))  # sum, clipped to ±5
    torch.testing.assert_close(integrate_granular(z, "mean"), torch.tensor([1.5, -3.5, 4.0]))
    torch.testing.assert_close(integrate_granular(z, "sum", clip=2.0), torch.tensor([2.0, -2.0, 2.0]))


def test_granular_credit_by_hand():
    """B = 1 row, K = 2 steps, G = 2 widths, M = 3: rows (k, g) = (0, 0), (0, 1), (1, 0), (1, 1); each
    (r, k)'s sum lands on its g = 0 row, the g = 1 rows get 0."""
    adv = torch.tensor([[1.0, 0, 0], [0.5, 0, 0], [0, -1.0, 0], [0, -2.5, 0]])  # (4, 3)
    out = granular_credit(adv, GranularShape((1, 2)), steps=2)
    want = torch.tensor([[1.5, 0, 0], [0, 0, 0], [0, -3.5, 0], [0, 0, 0]])
    torch.testing.assert_close(out, want)


def test_the_credit_path_equals_the_authors_rule_computed_independently():
    """Rewards ``r (B, K, G)`` of 2 groups × 3 rows: the library's path (the ``flow_grpo`` credit's
    z-score per (group, k, g) normalisation group, then :func:`granular_credit`) equals a direct loop:
    ``clip(Σ_g (r − mean)/(std + eps), ±5)`` over the rows of a group at each (k, g)."""
    gen = torch.Generator().manual_seed(0)
    b, k, g, m = 6, 2, 3, 4
    r = torch.randn(b, k, g, generator=gen) * 3  # (B, K, G)
    group = torch.arange(b) // 3
    norm = ((group.view(-1, 1, 1) * k + torch.arange(k).view(1, -1, 1)) * g + torch.arange(g)).reshape(-1)
    values = torch.full((b * k * g, m + 1), float("nan"))
    values[:, -1] = r.reshape(-1)
    trained = torch.tensor([True, True, False, False])
    z = CREDITS["flow_grpo"].fn(values, norm, trained)  # (B·K·G, M)
    got = granular_credit(z, GranularShape((1, 2, 3)), steps=k).view(b, k, g, m)
    want = torch.zeros(b, k)
    for p in range(2):
        rows = group == p
        for kk in range(k):
            total = 0.0
            for gg in range(g):
                x = r[rows, kk, gg]
                total = total + (x - x.mean()) / (x.std(unbiased=False) + 1e-4)
            want[rows, kk] = total.clamp(-5, 5)
    for kk in range(k):  # every trained step of a (r, k) row carries it; shape_credit keeps step k
        torch.testing.assert_close(got[:, kk, 0, 0], want[:, kk])
        torch.testing.assert_close(got[:, kk, 0, 1], want[:, kk])
    assert (got[:, :, 1:] == 0).all() and (got[..., 2:] == 0).all()


def test_schedule_plan_and_its_options():
    plan = _g2rpo_plan(S10)
    assert plan.branch and plan.sde.nonzero()[:, 0].tolist() == [0, 1, 2, 3, 4]  # the first half
    assert plan.granular == GranularShape((1, 2), "sum", 5.0)
    assert _g2rpo_plan(S10, fraction=0.2, widths="1,3,4").sde.nonzero()[:, 0].tolist() == [0, 1]
    for options, match in [
        ({"widths": "2,3"}, "increase from 1"),
        ({"widths": "1,1"}, "increase from 1"),
        ({"widths": "1;2"}, "like '1,2'"),
        ({"fraction": 1.0}, "10 of 10"),  # would train step M − 1
        ({"fraction": 0.0}, "lie in"),
        ({"integration": "max"}, "integration"),
    ]:
        with pytest.raises(ValueError, match=match):
            _g2rpo_plan(S10, **options)


def test_step_plan_rejects_granular_without_branches():
    sde = torch.tensor([True, False, False])
    with pytest.raises(ValueError, match="G²RPO"):
        StepPlan(torch.linspace(1, 0, 4), sde, sde.clone(), torch.arange(4), granular=GranularShape((1, 2)))
    last = torch.tensor([False, False, True])  # step M − 1 has no coarse completion
    with pytest.raises(ValueError, match="G²RPO"):
        StepPlan(
            torch.linspace(1, 0, 4), last, last.clone(), torch.arange(4), True, granular=GranularShape((1,))
        )


def test_rollout_rows_completions_and_network_calls(tmp_path):
    """4 steps, steps 0–1 branched, widths (1, 2): rows (r, k, g); g = 0 is the branch plan's own row;
    g = 1 shares x_0 … x_{k+1} and ends in Euler on the completion grid written out (k = 0: σ .75 →
    .5 → 0; k = 1: σ .5 → 0); only g = 0 rows train, at their k; the calls are the branch plan's plus
    one per coarse step."""
    s = session("g2rpo", tmp_path)
    batch, cond, plan, levels, sam = rollout_of(s)
    b, kn, gn = len(batch.group), 2, 2
    with torch.no_grad():
        fine = branch_sample(
            s.model, cond, batch.group, batch.x0, plan, levels, s.step_fn, *_gen(s), batch.rows
        )
    states = sam.ro.states.view(b, kn, gn, *sam.ro.states.shape[1:])
    torch.testing.assert_close(states[:, :, 0], fine.ro.states.view(b, kn, *fine.ro.states.shape[1:]))
    for k, grid in ((0, [0.75, 0.5, 0.0]), (1, [0.5, 0.0])):
        x = states[:, k, 1, k + 1]
        torch.testing.assert_close(x, states[:, k, 0, k + 1])  # the shared SDE step
        with torch.no_grad():
            for sigma, nxt in zip(grid, grid[1:]):
                x = x + (nxt - sigma) * velocity(s, x, sigma, cond[batch.group])
        torch.testing.assert_close(states[:, k, 1, -1], x)
    assert GRID[1:3] == [0.75, 0.5]
    trained = sam.row_trained.view(b, kn, gn, -1)
    assert trained[:, :, 1].sum() == 0 and trained[:, 0, 0, 0].all() and trained[:, 1, 0, 1].all()
    assert trained[:, :, 0].sum() == b * kn
    assert sam.nfe == fine.nfe + b * (2 + 1)  # k = 0: two coarse steps, k = 1: one
    assert sam.branches == kn * gn and sam.rows[0] == b * kn * gn
    assert len(torch.unique(sam.norm_group)) == 2 * kn * gn  # (group, k, g)
    per_row = rollout_calls(plan, s.cfg.group_size)
    assert per_row * b == pytest.approx(sam.nfe)


def _gen(s):
    from flowcredit.run.rollout import seeded

    return (seeded(s.cfg.seed, 0, 2),)
