"""Flash-GRPO (arXiv 2605.15980): the SDE ``flash_sde``, the rectification weights ``flash``, the per-group
schedule ``flash`` and its rollout (docs/algorithms.md, "Flash-GRPO"), by hand and against the authors'
table (Shredded-Pork/Flash-GRPO at 4211013, ``scripts/train_wanx2_1_flash.py`` L984)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flowcredit.errors import ConfigError
from flowcredit.presets import NEWER_PRESETS, PRESETS, load_config
from flowcredit.run.group_plans import group_sample, row_steps, step_runs
from flowcredit.run.plans import PLAN_PURPOSE, iteration_plan
from flowcredit.run.rollout import rollout, seeded
from flowcredit.schedule import sigmas as grid
from flowcredit.sde import SAMPLERS
from flowcredit.step_schedule_flash import flash_group_steps
from flowcredit.step_schedules import StepPlan, make_plan
from flowcredit.step_weights import flash_coefficients, step_weights

# --- the SDE -------------------------------------------------------------------------------------------


def _scalar(sigma, sigma_next, level):
    v, x = torch.full((1, 1), 0.5), torch.ones(1, 1)
    return SAMPLERS["flash_sde"](v, x, sigma, sigma_next, level, noise=torch.zeros(1, 1))


def test_flash_sde_by_hand():
    # x = 1, v = 0.5, σ = 0.5, σ' = 0.25, σ_max = 0.9: g = 0.45, dt = −0.25
    # mean = 1 − 0.25·[0.5 + 0.2025/1·(1 + 0.5·0.5)] = 0.81171875; std = 0.45·0.5 = 0.225
    out = _scalar(0.5, 0.25, 0.9)
    assert out.mean.item() == pytest.approx(0.81171875, abs=1e-7)
    assert out.std.item() == pytest.approx(0.225, abs=1e-7)
    # σ = 1 is finite (g = 0.9): mean = 1 − 0.25·[0.5 + 0.81/2·1] = 0.77375, std = 0.45
    first = _scalar(1.0, 0.75, 0.9)
    assert first.mean.item() == pytest.approx(0.77375, abs=1e-7) and first.std.item() == pytest.approx(0.45)


# --- the rectification weights -------------------------------------------------------------------------


def wan_grid(steps: int = 20, shift: float = 3.0) -> torch.Tensor:
    """Wan2.1's 20-step grid (diffusers' UniPC with flow sigmas: ``1 − linspace(1, 1/1000, N + 1)``,
    shifted, reversed, the last dropped, then σ = 0 appended), the grid of the authors' table."""
    raw = 1.0 - torch.linspace(1.0, 1.0 / 1000, steps + 1, dtype=torch.float64)
    shifted = (shift * raw / (1 + (shift - 1) * raw)).flip(0)[:-1]
    return torch.cat([shifted, torch.zeros(1, dtype=torch.float64)])


def test_coefficients_reproduce_the_authors_table():
    """Their ``value_dict`` (timesteps 999 … 785, the first 10 of 20 steps) from the equation."""
    table = [7.4770, 7.0414, 6.6112, 6.1867, 5.7682, 5.3559, 4.9502, 4.5513, 4.1596, 3.7754]
    sig = wan_grid()
    assert (sig[:10] * 1000).long().tolist() == [999, 982, 963, 944, 922, 899, 874, 847, 817, 785]
    assert flash_coefficients(sig)[:10].tolist() == pytest.approx(table, abs=6e-5)


def test_weights_by_hand_on_two_steps():
    # σ = (1, 0.5, 0): g = 0.5·σ; c_0 = 1/(√0.5/0.5) = √0.5; c_1 = 1/(√0.5/0.25 + 0.25·√0.5·0.5/1)
    # = 1/(4.125·√0.5), so c_1/c_0 = 16/33; over both steps' mean: 66/49 and 32/49
    sig, both = torch.tensor([1.0, 0.5, 0.0]), torch.tensor([True, True])
    assert flash_coefficients(sig).tolist() == pytest.approx([math.sqrt(0.5), 1 / (4.125 * math.sqrt(0.5))])
    assert step_weights("flash", sig, both).tolist() == pytest.approx([1.0, 16 / 33])  # K = ⌊2/2⌋ = 1
    got = step_weights("flash", sig, both, options={"candidates": 2})
    assert got.tolist() == pytest.approx([66 / 49, 32 / 49], rel=1e-6)
    only_second = step_weights("flash", sig, torch.tensor([False, True]), options={"candidates": 2})
    assert only_second.tolist() == pytest.approx([0.0, 32 / 49], rel=1e-6)


def independent_weights(sig: list[float], trained: list[bool], k: int) -> list[float]:
    """The weights in plain floats: c_i = g_i·√Δ_i / (Δ_i + g_i²·Δ_i·(1 − σ_i)/(2σ_i)) (the same
    quantity, multiplied through by g_i·√Δ_i), g_i = σ_N + (σ_1 − σ_N)·σ_i, over the mean of c_0 … c_{K−1}."""
    c = []
    for i in range(len(sig) - 1):
        g, d = sig[-1] + (sig[1] - sig[-1]) * sig[i], sig[i] - sig[i + 1]
        c.append(g * math.sqrt(d) / (d + g * g * d * (1 - sig[i]) / (2 * sig[i])))
    mean = sum(c[:k]) / k
    return [ci / mean if t else 0.0 for ci, t in zip(c, trained)]


@pytest.mark.parametrize("steps,shift,k", [(10, 1.0, 0), (10, 3.0, 7), (6, 2.0, 3), (20, 3.0, 10)])
def test_weights_equal_an_independent_computation(steps, shift, k):
    sig = grid(steps, shift)
    trained = torch.rand(steps, generator=torch.Generator().manual_seed(steps)) < 0.5
    want = independent_weights(sig.double().tolist(), trained.tolist(), k or steps // 2)
    got = step_weights("flash", sig, trained, std=torch.full((steps,), 9.0), options={"candidates": k})
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-7)  # std is not read


def test_weights_reject_bad_candidates():
    sig, trained = grid(4), torch.ones(4, dtype=torch.bool)
    with pytest.raises(ValueError, match="candidates"):
        step_weights("flash", sig, trained, options={"candidates": 5})
    with pytest.raises(ValueError, match="candidates"):
        step_weights("flash", sig, trained, options={"candidates": -1})
    with pytest.raises(ValueError, match="N >= 2"):
        step_weights("flash", grid(1), torch.ones(1, dtype=torch.bool))


# --- the schedule --------------------------------------------------------------------------------------


def _plan(iteration: int, groups: int = 4, steps: int = 10, seed: int = 0, **options) -> StepPlan:
    gen = seeded(seed, iteration, PLAN_PURPOSE)
    options = {"groups": groups, **options}
    return make_plan(
        "flash", grid(steps), level=0.9, iteration=iteration, total=5, generator=gen, options=options
    )


def test_schedule_draws_one_uniform_step_per_group_from_the_first_half():
    plan = _plan(3)
    want = torch.randint(0, 5, (4,), generator=seeded(0, 3, PLAN_PURPOSE))  # K = ⌊10/2⌋ = 5
    assert torch.equal(plan.group_step, want)
    taken = torch.zeros(10, dtype=torch.bool)
    taken[want] = True
    assert torch.equal(plan.sde, taken) and torch.equal(plan.trained, taken) and not plan.branch
    assert torch.equal(plan.sigmas, grid(10)) and torch.equal(plan.grid_index, torch.arange(11))
    draws = torch.cat([_plan(it, groups=8).group_step for it in range(50)])
    assert set(draws.tolist()) == {0, 1, 2, 3, 4}  # every candidate, nothing past the first half
    counts = torch.bincount(draws, minlength=5).float()
    assert counts.min() > 0.6 * counts.mean()


def test_schedule_is_a_function_of_the_iteration_and_the_generator():
    assert torch.equal(_plan(7).group_step, _plan(7).group_step)
    assert any(not torch.equal(_plan(0).group_step, _plan(it).group_step) for it in range(1, 5))
    assert not torch.equal(_plan(2, seed=0).group_step, _plan(2, seed=1).group_step)
    assert _plan(0, candidates=1).group_step.tolist() == [0, 0, 0, 0]
    assert _plan(0, steps=1).group_step.tolist() == [0, 0, 0, 0]  # ⌊1/2⌋ = 0: at least one step


def test_schedule_rejects_bad_options():
    with pytest.raises(ValueError, match="candidates"):
        _plan(0, candidates=11)
    with pytest.raises(ValueError, match="groups"):
        _plan(0, groups=0)
    with pytest.raises(ValueError, match="candidates"):
        flash_group_steps(4, 2, 5, torch.Generator())


def test_a_per_group_plan_must_match_its_steps():
    sig, sde = grid(4), torch.tensor([True, False, True, False])
    StepPlan(sig, sde, sde.clone(), torch.arange(5), group_step=torch.tensor([2, 0, 2]))
    with pytest.raises(ValueError, match="per-group"):
        StepPlan(sig, sde, sde.clone(), torch.arange(5), group_step=torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="per-group"):
        StepPlan(sig, sde, sde.clone(), torch.arange(5), branch=True, group_step=torch.tensor([2, 0]))


def test_the_preset_and_its_checks():
    cfg = load_config("flash_grpo")
    assert (cfg.sampler, cfg.noise_level, cfg.step_schedule, cfg.step_weight) == (
        "flash_sde",
        0.9,
        "flash",
        "flash",
    )
    assert cfg.noise_level == pytest.approx(float(grid(cfg.num_steps, cfg.shift)[1]))  # σ_max = σ_1
    assert (cfg.credit, cfg.global_std, cfg.shared_noise, cfg.clip_range, cfg.beta) == (
        "flow_grpo",
        True,
        False,
        1e-3,
        0.0,
    )
    names = list(PRESETS)  # registered after flow_dppo (tests/test_resume.py pairs kill points by position)
    assert "flash_grpo" in NEWER_PRESETS and names.index("flash_grpo") > names.index("flow_dppo")
    plan = iteration_plan(cfg, grid(cfg.num_steps), 5)
    assert plan.group_step.numel() == cfg.prompts_per_iter
    assert torch.equal(plan.group_step, iteration_plan(cfg, grid(cfg.num_steps), 5).group_step)
    with pytest.raises(ConfigError, match="credit=flow_grpo"):
        iteration_plan(dataclasses.replace(cfg, credit="dense"), grid(cfg.num_steps), 0)
    with pytest.raises(ConfigError, match="forward"):
        iteration_plan(dataclasses.replace(cfg, update="nft"), grid(cfg.num_steps), 0)
    with pytest.raises(ConfigError, match="prompts_per_iter"):
        load_config("flash_grpo", None, ["--step_schedule_options", '{"groups": 2}'])


def test_network_calls_count_one_trained_step_per_trajectory():
    from flowcredit.commands.bench_skill import nfe_parts

    assert nfe_parts(load_config("flash_grpo")) == {"rollout": 10.0, "values": 0, "update": 1.0}
    skill = load_config("skill", None, ["--step_schedule", "flash", "--step_weight", "flash"])
    assert nfe_parts(skill) == {"rollout": 10.0, "values": 0, "update": 2.0}  # β > 0: the reference too


# --- the rollout ---------------------------------------------------------------------------------------


class Affine:
    """A fake adapter: v = x/2 + cond (per prompt)."""

    def velocity(self, x, sigma, cond):
        return 0.5 * x + cond.view(-1, 1, 1, 1)


def test_runs_and_row_steps():
    assert step_runs(torch.tensor([3, 3, 1, 1, 3])) == [(0, 2), (2, 4), (4, 5)]
    assert step_runs(torch.tensor([2])) == [(0, 1)]
    assert row_steps(torch.tensor([4, 1, 0]), (6, 2, 6)).tolist() == [1, 1, 0, 0]
    with pytest.raises(ValueError, match="equal groups"):
        row_steps(torch.tensor([4, 1, 0]), (7, 0, 7))


def _group_rollout(rows, x0, group, plan, levels):
    gen = seeded(0, 1, 2)
    cond = torch.tensor([0.1, -0.2, 0.3])
    return group_sample(Affine(), cond, group, x0, plan, levels, SAMPLERS["flash_sde"], gen, rows)


def test_each_row_explores_its_groups_step_only_and_splits_like_one_batch():
    sig = grid(4)
    sde = torch.tensor([True, False, True, False])
    plan = StepPlan(sig, sde, sde.clone(), torch.arange(5), group_step=torch.tensor([2, 0, 2]))
    levels = torch.where(sde, torch.tensor(0.75), torch.tensor(0.0))
    x0 = torch.randn(6, 1, 2, 2, generator=torch.Generator().manual_seed(5))
    group = torch.tensor([0, 0, 1, 1, 2, 2])
    whole = _group_rollout((6, 0, 6), x0, group, plan, levels)
    assert whole.row_trained.nonzero()[:, 1].tolist() == [2, 2, 0, 0, 2, 2] and whole.nfe == 24
    assert ((whole.ro.std > 0) == whole.row_trained).all() and (
        (whole.ro.logp != 0) == whole.row_trained
    ).all()
    # rank 0 holds group 0, rank 1 groups 1 and 2 (local ids 0, 1): the same rows
    lo = _group_rollout((6, 0, 2), x0[:2], group[:2], plan, levels)
    hi_cond = torch.tensor([-0.2, 0.3])
    gen = seeded(0, 1, 2)
    hi = group_sample(
        Affine(),
        hi_cond,
        torch.tensor([0, 0, 1, 1]),
        x0[2:],
        plan,
        levels,
        SAMPLERS["flash_sde"],
        gen,
        (6, 2, 6),
    )
    assert torch.equal(torch.cat([lo.ro.states, hi.ro.states]), whole.ro.states)
    assert torch.equal(torch.cat([lo.ro.logp, hi.ro.logp]), whole.ro.logp)
    # a row of group 1 is the one-batch rollout with the SDE at step 0 only, at its global index
    one = torch.tensor([0.75, 0.0, 0.0, 0.0])
    ref = rollout(
        Affine(), torch.tensor([0.1, -0.2, 0.3]), group, x0, sig, one, SAMPLERS["flash_sde"], seeded(0, 1, 2)
    )
    assert torch.equal(whole.ro.states[2:4], ref.states[2:4])


def test_the_skill_arm_changes_flash_grpos_fields_at_the_presets_network_calls():
    """The pre-registered arm (docs/benchmarks.md, "Flash-GRPO's claim"): the schedule, weight and SDE
    only, at 750 iterations (12 calls per trajectory against the preset's 20)."""
    from flowcredit.commands.bench_skill import SKILL_ARMS, SKILL_CLAIMS, nominal_calls

    base = load_config("skill")
    arm = load_config("skill", None, SKILL_ARMS["flash"](base))
    changed = {k: v for k, v in vars(arm).items() if getattr(base, k) != v}
    assert changed == {
        "step_schedule": "flash",
        "step_weight": "flash",
        "sampler": "flash_sde",
        "noise_level": 0.9,
        "iterations": 750,
    }
    assert arm.iterations * nominal_calls(arm) == base.iterations * nominal_calls(base)
    claim = ("skill-flash", "Flash-GRPO: at least as good as Flow-GRPO at equal network calls", "noninferior")
    assert claim in SKILL_CLAIMS
