"""Step schedules and per-step loss weights (flowcredit.step_schedules) against hand-computed tensors."""

import math

import pytest
import torch

from flowcredit.config import Config, trained_window
from flowcredit.run.rollout import noise_levels
from flowcredit.schedule import exponential_shift_sigmas, resolution_shift_mu, sigmas
from flowcredit.step_schedules import (
    STEP_SCHEDULES,
    StepPlan,
    flow_sde_std,
    make_plan,
    merge_entropy,
    merge_units,
    plan_levels,
    register_step_schedule,
    step_entropy,
)
from flowcredit.step_weights import STEP_WEIGHTS, register_step_weight, step_weights

T, F = True, False
LINEAR5 = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])  # sigmas(5), no shift
SHIFT5 = torch.tensor([1.0, 12 / 13, 9 / 11, 2 / 3, 3 / 7, 0.0])  # sigmas(5, shift=3): 3u/(1 + 2u)


def _plan(name, grid, iteration=0, total=100, level=0.7, seed=0, **options):
    gen = torch.Generator().manual_seed(seed)
    return make_plan(
        name, grid, level=level, iteration=iteration, total=total, generator=gen, options=options
    )


def _window_of(plan):
    idx = torch.nonzero(plan.sde, as_tuple=True)[0].tolist()
    return (idx[0], idx[-1] + 1) if idx else None


def _b(*values):
    return torch.tensor(values, dtype=torch.bool)


# --- window: today's behaviour ---


@pytest.mark.parametrize(
    "n, start, size, level",
    [(10, 0, 0, 0.7), (10, 2, 3, 0.5), (10, 9, 1, 1.0), (6, 1, 0, 0.3), (4, 0, 4, 0.7), (1, 0, 1, 0.7)],
)
def test_window_reproduces_noise_levels(n, start, size, level):
    cfg = Config(num_steps=n, window_start=start, window_size=size, noise_level=level)
    levels, trained = noise_levels(cfg, None)
    plan = _plan("window", sigmas(n), level=level, start=start, size=size)
    assert torch.equal(plan.trained, trained) and torch.equal(plan.sde, trained)
    torch.testing.assert_close(plan_levels(plan, level), levels, rtol=0, atol=0)
    assert torch.equal(plan.sigmas, sigmas(n)) and torch.equal(plan.grid_index, torch.arange(n + 1))
    assert not plan.branch
    w, k = trained_window(cfg)
    assert _window_of(plan) == (w, w + k)
    psi = torch.linspace(0.1, 1.0, n)  # DenseGRPO's calibrated ψ replaces the level inside the window
    torch.testing.assert_close(plan_levels(plan, level, psi), noise_levels(cfg, psi)[0], rtol=0, atol=0)


def test_window_fields_are_config_fields():
    assert STEP_SCHEDULES["window"].fields == {"start": "window_start", "size": "window_size"}
    assert all(hasattr(Config(), f) for f in STEP_SCHEDULES["window"].fields.values())


def test_window_errors_name_the_option():
    with pytest.raises(ValueError, match="option 'start' must lie in \\[0, 5\\), got 5"):
        _plan("window", LINEAR5, start=5)
    with pytest.raises(ValueError, match="option 'size' gives \\[3, 6\\)"):
        _plan("window", LINEAR5, start=3, size=3)
    with pytest.raises(ValueError, match="option 'size' gives \\[4, 4\\)"):  # size 0 from the last step
        _plan("window", LINEAR5, start=4)
    with pytest.raises(ValueError, match="option 'size' must be >= 0, got -1"):
        _plan("window", LINEAR5, size=-1)
    with pytest.raises(ValueError, match="'window' has no option 'sise' \\(options: size, start\\)"):
        _plan("window", LINEAR5, sise=2)
    with pytest.raises(ValueError, match="option 'start' must be int, got 1.5"):
        _plan("window", LINEAR5, start=1.5)


# --- MixGRPO ---

MIX = dict(size=4, stride=1, interval=2, skip_last=2)  # N = 10: windows within [0, 8)


@pytest.mark.parametrize(
    "iteration, window",
    [
        (0, (0, 4)),
        (1, (0, 4)),
        (2, (1, 5)),
        (3, (1, 5)),
        (10, (5, 8)),
        (13, (6, 8)),
        (15, (7, 8)),
        (16, (0, 4)),
    ],
)
def test_mixgrpo_progressive_slides_then_rolls_back(iteration, window):
    # starts 0 … 7, each held 2 iterations (cycle of 16); the window is cut at N − skip_last = 8
    plan = _plan("mixgrpo", sigmas(10), iteration=iteration, **MIX)
    assert _window_of(plan) == window
    assert torch.equal(plan.trained, plan.sde) and not plan.branch


def test_mixgrpo_progressive_without_roll_back_stays_at_the_end():
    assert _window_of(_plan("mixgrpo", sigmas(10), iteration=16, **MIX, roll_back=False)) == (7, 8)
    assert _window_of(_plan("mixgrpo", sigmas(10), iteration=999, **MIX, roll_back=False)) == (7, 8)


def test_mixgrpo_stride_of_a_whole_window():
    # stride 4: starts 0, 4 (cycle of 4 iterations)
    mix = {**MIX, "stride": 4}
    windows = [_window_of(_plan("mixgrpo", sigmas(10), iteration=i, **mix)) for i in range(5)]
    assert windows == [(0, 4), (0, 4), (4, 8), (4, 8), (0, 4)]


@pytest.mark.parametrize(
    "iteration, start", [(0, 0), (9, 0), (10, 1), (17, 1), (18, 2), (31, 4), (44, 7), (45, 0)]
)
def test_mixgrpo_decay(iteration, start):
    # τ(s) = max(1, int(10·(1 − s/8) + 1·s/8)) = 10, 8, 7, 6, 5, 4, 3, 2 for s = 0 … 7
    # cumulative: 10, 18, 25, 31, 36, 40, 43, 45
    plan = _plan("mixgrpo", sigmas(10), iteration=iteration, **MIX, strategy="decay")
    assert _window_of(plan)[0] == start


@pytest.mark.parametrize(
    "iteration, start", [(0, 0), (11, 2), (12, 3), (14, 3), (15, 4), (17, 5), (19, 7), (20, 0)]
)
def test_mixgrpo_exp_decay(iteration, start):
    # τ(s) = ceil(4·exp(−0.5·max(0, s − 2))) = 4, 4, 4, 3 (2.43), 2 (1.47), 1, 1, 1
    # cumulative: 4, 8, 12, 15, 17, 18, 19, 20
    mix = {**MIX, "interval": 4, "decay_from": 2, "decay_rate": 0.5}
    plan = _plan("mixgrpo", sigmas(10), iteration=iteration, **mix, strategy="exp_decay")
    assert _window_of(plan)[0] == start


def test_mixgrpo_random_draws_from_the_generator():
    for seed in range(20):
        start = int(torch.randint(0, 5, (1,), generator=torch.Generator().manual_seed(seed)))
        plan = _plan("mixgrpo", sigmas(10), seed=seed, **MIX, strategy="random")
        assert _window_of(plan) == (start, start + 4)  # start in [0, 8 − 4]


def test_mixgrpo_defaults_are_the_authors_script():
    plan = _plan("mixgrpo", sigmas(25), iteration=26)  # w = 4, τ = 25, stride 1: window moved once
    assert _window_of(plan) == (1, 5)
    assert _window_of(_plan("mixgrpo", sigmas(25), iteration=22 * 25)) == (22, 23)  # bound N − 2
    assert _window_of(_plan("mixgrpo", sigmas(25), iteration=23 * 25)) == (0, 4)  # rolled back


def test_mixgrpo_errors_name_the_option():
    with pytest.raises(ValueError, match="'mixgrpo': option 'strategy' must be one of"):
        _plan("mixgrpo", LINEAR5, strategy="linear")
    with pytest.raises(ValueError, match="'mixgrpo': option 'size' must be >= 1, got 0"):
        _plan("mixgrpo", LINEAR5, size=0)
    with pytest.raises(ValueError, match="'mixgrpo': option 'skip_last' leaves no step of the 5"):
        _plan("mixgrpo", LINEAR5, skip_last=5)
    with pytest.raises(ValueError, match="option 'roll_back' must be bool, got 1"):
        _plan("mixgrpo", LINEAR5, roll_back=1)


# --- TempFlow-GRPO branch steps ---


def test_tempflow_all_branches_like_the_authors_code():
    plan = _plan("tempflow", LINEAR5)
    assert plan.branch
    assert torch.equal(plan.sde, _b(T, T, T, T, F)) and torch.equal(plan.trained, plan.sde)
    assert torch.equal(plan.sigmas, LINEAR5)


def test_tempflow_one_branch_step_per_iteration():
    plan = _plan("tempflow", LINEAR5, iteration=6, branches="cycle")  # K = 4 branch points: 6 mod 4
    assert torch.equal(plan.sde, _b(F, F, T, F, F)) and plan.branch
    for seed in range(10):
        k = int(torch.randint(0, 4, (1,), generator=torch.Generator().manual_seed(seed)))
        plan = _plan("tempflow", LINEAR5, seed=seed, branches="uniform")
        assert torch.nonzero(plan.sde).flatten().tolist() == [k]
    plan = _plan("tempflow", LINEAR5, iteration=4, branches="cycle", skip_last=0)  # the last step too
    assert torch.equal(plan.sde, _b(F, F, F, F, T))


def test_tempflow_errors_name_the_option():
    with pytest.raises(ValueError, match="'tempflow': option 'branches' must be one of"):
        _plan("tempflow", LINEAR5, branches="every")
    with pytest.raises(ValueError, match="'tempflow': option 'skip_last' leaves no branch step"):
        _plan("tempflow", LINEAR5, skip_last=5)


# --- E-GRPO merged steps ---


def test_step_entropy_of_flow_sde_steps():
    # a = 1 on LINEAR5: g = √(σ/(1 − σ)) (σ̃ = σ' at σ = 1), std = g·√(σ − σ')
    std = flow_sde_std(LINEAR5[:-1], LINEAR5[1:], 1.0)
    torch.testing.assert_close(std, torch.tensor([1.0, 0.894427, 0.547723, 0.365148, 0.223607]))
    # ½·log(2πe) = 1.418939, plus log std
    h = step_entropy(std)
    torch.testing.assert_close(h, torch.tensor([1.418939, 1.307367, 0.816953, 0.411486, -0.078927]))
    # merged 0.6 → 0.2: g = √1.5 = 1.224745, std = 1.224745·√0.4 = 0.774597, H = 1.418939 − 0.255413
    merged = step_entropy(flow_sde_std(torch.tensor(0.6), torch.tensor(0.2), 1.0))
    torch.testing.assert_close(merged, torch.tensor(1.163526))


def test_merge_units_hand_computed():
    # H(k, 1) = 1.42, 1.31, 0.82, 0.41, −0.08; H(2, 2) = 1.16; H(3, 2) = 0.76; H(1, 2) = 1.65
    assert merge_units(LINEAR5, 1.0, threshold=1.0, horizon=1.0) == [(0, 1), (1, 1), (2, 2)]
    assert merge_units(LINEAR5, 1.0, threshold=1.0, horizon=0.5) == [(0, 1), (1, 1)]  # ends ≤ 2
    assert merge_units(LINEAR5, 1.0, threshold=1.35, horizon=1.0) == [(0, 1), (1, 2)]
    # a = 0.7 moves every H by log 0.7 = −0.356675: H(1, 1) = 0.95 < 1, H(1, 2) = 1.30
    assert merge_units(LINEAR5, 0.7, threshold=1.0, horizon=1.0) == [(0, 1), (1, 2)]


QUARTERS = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])  # sigmas(4), no shift


def test_a_step_from_sigma_one_merges_by_infinite_entropy():
    # from σ = 1 the sampled std is a = 0.7 however far it is merged (σ̃ = σ'): H = 1.418939 + log 0.7
    std = flow_sde_std(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0.75, 0.5, 0.0]), 0.7)
    torch.testing.assert_close(step_entropy(std), torch.full((3,), 1.062264))
    # so merge_entropy reads it as infinite (the paper); off σ = 1 it is step_entropy:
    # σ .75 → .25: g = 0.7·√3 = 1.212436, std = g·√0.5 = 0.857321, H = 1.418939 − 0.153943
    h = merge_entropy(torch.tensor([1.0, 0.75]), torch.tensor([0.75, 0.25]), 0.7)
    assert h[0].item() == math.inf
    torch.testing.assert_close(h[1], torch.tensor(1.264996))


def test_merge_units_below_and_above_the_entropy_from_sigma_one():
    """Thresholds below and above ½·log(2πe) + log 0.7 = 1.0623 (issue 53): step 0 stands alone."""
    # a = 0.7 on QUARTERS, H = 1.418939 + log(g·√(σ − σ')), g = 0.7·√(σ/(1 − σ)):
    # H(1, m), m = 1, 2, 3: 0.918423, 1.264996, 1.467729 (std 0.606218, 0.857321, 1.05)
    # H(2, m), m = 1, 2: 0.369116, 0.715690 (std 0.35, 0.494975); H(3, 1) = −0.180190
    assert merge_units(QUARTERS, 0.7, threshold=0.9, horizon=1.0) == [(0, 1), (1, 1)]  # H(2, 2) < 0.9
    assert merge_units(QUARTERS, 0.7, threshold=1.0, horizon=1.0) == [(0, 1), (1, 2)]
    assert merge_units(QUARTERS, 0.7, threshold=1.2, horizon=1.0) == [(0, 1), (1, 2)]
    assert merge_units(QUARTERS, 0.7, threshold=1.3, horizon=1.0) == [(0, 1), (1, 3)]
    assert merge_units(QUARTERS, 0.7, threshold=1.3, horizon=0.75) == [(0, 1)]  # (1, 3) ends at 4 > 3
    # 16 steps, shift 3: σ_k = 3(16 − k)/(48 − 2k); threshold 1.2, horizon ⌊0.5·16⌋ = 8:
    # H(1, 1) = 1.094780 < 1.2 ≤ H(1, 2) = 1.464613 (g = 0.7·√45, σ 45/46 → 39/42);
    # H(3, 3) = 1.169051 < 1.2 ≤ H(3, 4) = 1.341471 (g = 0.7·√13, σ 39/42 → 27/34); from 7 it
    # takes σ' ≤ 0.4526, step 13 > 8
    assert merge_units(sigmas(16, 3.0), 0.7, threshold=1.2, horizon=0.5) == [(0, 1), (1, 2), (3, 4)]
    plan = _plan("egrpo", sigmas(16, 3.0), threshold=1.2)
    assert plan.grid_index.tolist() == [0, 1, 3, *range(7, 17)]
    assert torch.nonzero(plan.sde).flatten().tolist() == [0, 1, 2]


def test_egrpo_plan_on_the_merged_grid():
    plan = _plan("egrpo", LINEAR5, level=1.0, threshold=1.0, horizon=1.0)
    assert plan.grid_index.tolist() == [0, 1, 2, 4, 5]
    torch.testing.assert_close(plan.sigmas, torch.tensor([1.0, 0.8, 0.6, 0.2, 0.0]))
    assert torch.equal(plan.sde, _b(T, T, T, F)) and torch.equal(plan.trained, plan.sde)
    assert plan.branch
    torch.testing.assert_close(plan_levels(plan, 0.7), torch.tensor([0.7, 0.7, 0.7, 0.0]))
    plan = _plan("egrpo", LINEAR5, level=1.0, threshold=1.35, horizon=1.0, branch=False)
    assert plan.grid_index.tolist() == [0, 1, 3, 4, 5] and not plan.branch
    assert torch.equal(plan.sde, _b(T, T, F, F))


def test_egrpo_defaults_reproduce_the_authors_run():
    # their script: 16 steps, shift 3, eta 0.7, eta_step_list 0 1 2 4, eta_step_merge_list 1 1 2 3
    assert merge_units(sigmas(16, 3.0), 0.7, threshold=1.0, horizon=0.5) == [(0, 1), (1, 1), (2, 2), (4, 3)]
    plan = _plan("egrpo", sigmas(16, 3.0))
    assert plan.grid_index.tolist() == [0, 1, 2, 4, *range(7, 17)]
    assert torch.nonzero(plan.sde).flatten().tolist() == [0, 1, 2, 3]


def test_egrpo_errors_name_the_option():
    only_first = _plan("egrpo", LINEAR5, threshold=5.0)  # step 0 is a unit at any threshold, no other step is
    assert torch.nonzero(only_first.sde).flatten().tolist() == [0]  # as before 2026-12-06: no error
    with pytest.raises(ValueError, match="'egrpo': option 'threshold' 1.0 is reached by no step within"):
        _plan("egrpo", LINEAR5, threshold=1.0, horizon=0.1)  # ⌊0.1·5⌋ = 0: not even step 0
    with pytest.raises(ValueError, match="'egrpo': option 'horizon' must lie in \\(0, 1\\]"):
        _plan("egrpo", LINEAR5, horizon=0.0)


def test_step_plan_checks_itself():
    with pytest.raises(ValueError, match="a trained step must be an SDE step"):
        StepPlan(LINEAR5, _b(T, F, F, F, F), _b(T, T, F, F, F), torch.arange(6))
    with pytest.raises(ValueError, match="shapes disagree"):
        StepPlan(LINEAR5, _b(T, F), _b(T, F), torch.arange(3))
    with pytest.raises(ValueError, match="grid_index must increase"):
        StepPlan(LINEAR5, _b(T, F, F, F, F), _b(T, F, F, F, F), torch.tensor([0, 1, 1, 3, 4, 5]))


# --- per-step loss weights ---


def test_uniform_weights_are_today():
    w = step_weights("uniform", LINEAR5, _b(F, T, T, F, F))
    torch.testing.assert_close(w, torch.tensor([0.0, 1.0, 1.0, 0.0, 0.0]))


def test_tempflow_weights_hand_computed():
    std = torch.tensor([0.7, 0.5, 0.3, 0.2, 0.1])
    trained = _b(T, T, T, F, F)  # mean std over trained steps 0.5
    w = step_weights("tempflow", LINEAR5, trained, std)
    torch.testing.assert_close(w, torch.tensor([1.4, 1.0, 0.6, 0.0, 0.0]))
    w = step_weights("tempflow", LINEAR5, trained, std, {"normalize": False})
    torch.testing.assert_close(w, torch.tensor([0.7, 0.5, 0.3, 0.0, 0.0]))
    with pytest.raises(ValueError, match="need the per-step std of shape \\(5,\\), got None"):
        step_weights("tempflow", LINEAR5, trained)


def test_tempflow_weights_match_the_authors_constants():
    # SD3.5: 10 steps, shift 3, a = 0.7, steps 0 … 8 trained; code: loss · 2.25·std_i
    grid = sigmas(10, 3.0)
    trained = torch.arange(10) < 9
    std = flow_sde_std(grid[:-1], grid[1:], 0.7)
    assert abs(1 / std[trained].mean().item() - 2.25) < 0.01  # 2.2414
    # FLUX.1 at 1024 px (4096 tokens, μ = 1.15): linspace(1, 1/10, 10) shifted, a = 0.9; code: 1.73
    grid = torch.cat(
        [exponential_shift_sigmas(torch.linspace(1, 0.1, 10), resolution_shift_mu(4096)), torch.zeros(1)]
    )
    std = flow_sde_std(grid[:-1], grid[1:], 0.9)
    assert abs(1 / std[trained].mean().item() - 1.73) < 0.01  # 1.7260


def test_grpo_guard_weights_hand_computed():
    # Δt = 1/13, 15/143, 5/33, 5/21, 3/7 → 1/Δt = 13, 9.533333, 6.6, 4.2, 2.333333
    w = step_weights("grpo_guard", SHIFT5, _b(T, T, T, T, T))
    torch.testing.assert_close(w, torch.tensor([13.0, 9.533333, 6.6, 4.2, 2.333333]))
    w = step_weights("grpo_guard", SHIFT5, _b(F, T, T, F, F))
    torch.testing.assert_close(w, torch.tensor([0.0, 9.533333, 6.6, 0.0, 0.0]))
    # normalised by the trained mean 8.066667: 143/121, 99/121
    w = step_weights("grpo_guard", SHIFT5, _b(F, T, T, F, F), options={"normalize": True})
    torch.testing.assert_close(w, torch.tensor([0.0, 1.181818, 0.818182, 0.0, 0.0]))


def test_weight_option_errors():
    with pytest.raises(ValueError, match="'tempflow' has no option 'normalise' \\(options: normalize\\)"):
        step_weights("tempflow", LINEAR5, _b(T, F, F, F, F), torch.ones(5), {"normalise": True})
    with pytest.raises(ValueError, match="option 'normalize' must be bool, got 1"):
        step_weights("grpo_guard", LINEAR5, _b(T, F, F, F, F), options={"normalize": 1})
    with pytest.raises(ValueError, match="unknown step weight 'none'"):
        step_weights("none", LINEAR5, _b(T, F, F, F, F))


# --- a schedule and a weight registered from outside the package ---


def every_other(sigmas, *, level, iteration, total, generator, phase=0):
    """SDE on the steps i with (i + iteration + phase) even."""
    n = sigmas.numel() - 1
    sde = (torch.arange(n) + iteration + phase) % 2 == 0
    return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1))


def late_heavy(sigmas, trained, std=None, *, power=1.0):
    """(1 − σ_i)^power on trained steps."""
    return torch.where(trained, (1 - sigmas[:-1]) ** power, torch.zeros(trained.shape))


@pytest.fixture
def toy_entries():
    register_step_schedule("every_other", every_other, {"phase": 0})
    register_step_weight("late_heavy", late_heavy)  # options from the function: {"power": 1.0}
    yield
    del STEP_SCHEDULES["every_other"], STEP_WEIGHTS["late_heavy"]


def test_a_schedule_registered_from_outside(toy_entries):
    plan = _plan("every_other", LINEAR5, iteration=3)
    assert torch.equal(plan.sde, _b(F, T, F, T, F))
    plan = _plan("every_other", LINEAR5, iteration=3, phase=1)
    assert torch.equal(plan.sde, _b(T, F, T, F, T))
    with pytest.raises(ValueError, match="'every_other' has no option 'phaze' \\(options: phase\\)"):
        _plan("every_other", LINEAR5, phaze=1)
    assert STEP_WEIGHTS["late_heavy"].options == {"power": 1.0}
    w = step_weights("late_heavy", LINEAR5, _b(F, T, T, F, F), options={"power": 2})  # int for float
    torch.testing.assert_close(w, torch.tensor([0.0, 0.04, 0.16, 0.0, 0.0]))
    with pytest.raises(ValueError, match="already registered"):
        register_step_schedule("every_other", every_other)


def test_registration_checks_the_function():
    def no_generator(sigmas, *, level, iteration, total, width=2):
        return None

    with pytest.raises(ValueError, match="'bad': its function takes no keyword 'generator'"):
        register_step_schedule("bad", no_generator)
    with pytest.raises(ValueError, match="its function takes no keyword 'height'"):
        register_step_schedule("bad", every_other, {"height": 1})
    with pytest.raises(ValueError, match="fields name options it does not have"):
        register_step_schedule("bad", every_other, {"phase": 0}, fields={"width": "window_size"})
    assert "bad" not in STEP_SCHEDULES
    with pytest.raises(ValueError, match="unknown step schedule 'nope'; registered: .*egrpo, flash, g2rpo"):
        _plan("nope", LINEAR5)
    assert math.isclose(STEP_SCHEDULES["egrpo"].options["threshold"], 1.0)
