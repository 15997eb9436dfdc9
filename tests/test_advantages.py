"""Hand-computed advantages (expected numbers worked out on paper / a calculator, written here)."""

import pytest
import torch

from flowcredit.advantages import ADVANTAGES, turning_points

T, F = True, False


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_flow_grpo_group_std():
    values = torch.full((6, 3), float("nan"))  # only V_N is needed
    values[:, -1] = _t([1, 2, 3, 5, 5, 5])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = ADVANTAGES["flow_grpo"](values, group, torch.tensor([T, F]))
    # group 0: mean 2, population std √(2/3) = 0.8164966 → ±1/(0.8164966 + 1e-4) = ±1.2245949
    expected = torch.zeros(6, 2)
    expected[:3, 0] = _t([-1.2245949, 0.0, 1.2245949])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)
    assert not adv.isnan().any()


def test_flow_grpo_global_std():
    values = torch.zeros(6, 3)
    values[:, -1] = _t([1, 2, 3, 5, 5, 5])
    adv = ADVANTAGES["flow_grpo"](
        values, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([T, T]), global_std=True
    )
    # batch std of [1,2,3,5,5,5] = √(15.5/6) = 1.6072751 → group 0: ±1/(1.6072751 + 1e-4) = ±0.6221323
    expected = torch.zeros(6, 2)
    expected[:3] = _t([-0.6221323, 0.0, 0.6221323]).view(3, 1)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)


def test_flow_grpo_clip():
    values = torch.zeros(6, 2)
    values[:, -1] = _t([0, 0, 0, 0, 0, 1])
    adv = ADVANTAGES["flow_grpo"](values, torch.zeros(6, dtype=torch.long), torch.tensor([T]), adv_clip=2.0)
    assert adv.max().item() == 2.0  # (1 − 1/6)/0.3727 = 2.236 before clipping


DENSE_VALUES = _t([[0, 0.2, 0.5], [0, 0.4, 0.4], [1, 1, 1], [1, 1, 1]])  # d: [.2,.3], [.4,0], 0, 0
DENSE_GROUP = torch.tensor([0, 0, 1, 1])


def test_dense_per_group_and_step():
    adv = ADVANTAGES["dense"](DENSE_VALUES, DENSE_GROUP, torch.tensor([T, T]))
    # step 0: [.2,.4] → ∓0.1/(0.1 + 1e-4) = ∓0.9990010; step 1: [.3, 0] → ±0.15/0.1501 = ±0.9993338
    expected = _t([[-0.9990010, 0.9993338], [0.9990010, -0.9993338], [0, 0], [0, 0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)


def test_dense_untrained_steps_zero_even_with_nan_values():
    values = DENSE_VALUES.clone()
    values[:, 2] = float("nan")  # V_2 unneeded when step 1 is not trained
    adv = ADVANTAGES["dense"](values, DENSE_GROUP, torch.tensor([T, F]))
    assert torch.equal(adv[:, 1], torch.zeros(4)) and not adv.isnan().any()


def test_stepwise_joint_normalisation():
    adv = ADVANTAGES["stepwise"](DENSE_VALUES, DENSE_GROUP, torch.tensor([T, T]))
    # group 0 pooled d = [.2, .3, .4, 0]: mean .225, std √(0.0875/4) = 0.1479020
    expected = _t([[-0.1689166, 0.5067499], [1.1824165, -1.5202498], [0, 0], [0, 0]])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)
    # only trained entries enter the statistics: with step 1 untrained, group 0 pools [.2, .4]
    only0 = ADVANTAGES["stepwise"](DENSE_VALUES, DENSE_GROUP, torch.tensor([T, F]))
    torch.testing.assert_close(only0[:2, 0], _t([-0.9990010, 0.9990010]), rtol=0, atol=1e-5)


# Turning points: rows A, B, E in group 0 and C, D in group 1; window = steps 0..2 (step 3 untrained).
TP_VALUES = _t(
    [
        [0.5, 0.3, 0.6, 0.7, 0.8],  # A: d = [-.2, .3, .1, .1], Δ = +.3, s = [-, +, +]: TP at 1 (agg +.5)
        [
            0.5,
            0.7,
            0.4,
            0.45,
            0.4,
        ],  # B: d = [.2, -.3, .05, -.05], Δ = -.1: TP at 1 only unconstrained (V_N − V_2 = 0)
        [0.5, 0.6, 0.65, 0.7, 0.9],  # C: all positive: first step is a TP (agg = Δ = .4)
        [0.5, 0.5, 0.5, 0.5, 0.5],  # D: all zero: never a TP
        [0.5, 0.45, 0.55, 0.6, 0.6],  # E: d = [-.05, .1, .05, 0], Δ = +.1: TP at 1 (agg +.15)
    ]
)
TP_GROUP = torch.tensor([0, 0, 1, 1, 0])
TP_TRAINED = torch.tensor([T, T, T, F])


def test_turning_points_constrained_and_unconstrained():
    con = turning_points(TP_VALUES, TP_TRAINED, constrained=True, first_step=True)
    expected = torch.zeros(5, 4, dtype=torch.bool)
    expected[0, 1] = expected[2, 0] = expected[4, 1] = True
    assert torch.equal(con, expected)
    unc = turning_points(TP_VALUES, TP_TRAINED, constrained=False, first_step=True)
    expected[1, 1] = True
    assert torch.equal(unc, expected)
    no_first = turning_points(TP_VALUES, TP_TRAINED, constrained=True, first_step=False)
    assert not no_first[:, 0].any() and torch.equal(no_first[:, 1:], con[:, 1:])


def test_turning_point_advantages_constrained():
    adv = ADVANTAGES["turning_point"](TP_VALUES, TP_GROUP, TP_TRAINED)
    # group 0 (A, B, E): step 0 d = [-.2, .2, -.05]; step 1 [agg .5, d -.3, agg .15]; step 2 [.1, .05, .05]
    # group 1 (C, D): step 0 [agg .4, 0]; step 1 [.05, 0]; step 2 [.05, 0]
    expected = torch.zeros(5, 4)
    expected[[0, 1, 4], 0] = _t([-1.1104947, 1.3124029, -0.2019081])
    expected[[0, 1, 4], 1] = _t([1.1703118, -1.2720780, 0.1017662])
    expected[[0, 1, 4], 2] = _t([1.4082389, -0.7041195, -0.7041195])
    expected[[2, 3], 0] = _t([0.9995003, -0.9995003])
    expected[[2, 3], 1] = _t([0.9960159, -0.9960159])
    expected[[2, 3], 2] = _t([0.9960159, -0.9960159])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-5)


def test_turning_point_balancing_with_both_signs():
    # unconstrained, group 0 TPs: A1 (+.5), B1 (−.3), E1 (+.15) → keep one of each sign: A1 and B1;
    # E1 returns to d = .1, so step 1 is [.5, −.3, .1] → z = [1.2243700, −1.2243700, 0]
    adv = ADVANTAGES["turning_point"](TP_VALUES, TP_GROUP, TP_TRAINED, constrained=False)
    torch.testing.assert_close(adv[[0, 1, 4], 1], _t([1.2243700, -1.2243700, 0.0]), rtol=0, atol=1e-5)
    # without balancing E1 keeps its aggregated reward .15
    unbalanced = ADVANTAGES["turning_point"](
        TP_VALUES, TP_GROUP, TP_TRAINED, constrained=False, balance="none"
    )
    col = _t([0.5, -0.3, 0.15])
    z = (col - col.mean()) / (col.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(unbalanced[[0, 1, 4], 1], z, rtol=0, atol=1e-5)


def test_turning_point_first_step_rule_off():
    adv = ADVANTAGES["turning_point"](TP_VALUES, TP_GROUP, TP_TRAINED, first_step=False)
    # group 1 step 0 is now d = [.1, 0]: mean .05, std .05 → ±0.05/0.0501 = ±0.9980040
    torch.testing.assert_close(adv[[2, 3], 0], _t([0.9980040, -0.9980040]), rtol=0, atol=1e-5)


def test_turning_point_needs_contiguous_window():
    with pytest.raises(ValueError, match="contiguous"):
        turning_points(TP_VALUES, torch.tensor([T, F, T, F]))


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_equal_values_give_zeros_never_nan(name):
    values = torch.full((6, 5), 0.3)
    adv = ADVANTAGES[name](values, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([T, T, T, F]))
    assert adv.shape == (6, 4) and torch.equal(adv, torch.zeros(6, 4))


@pytest.mark.parametrize("name", list(ADVANTAGES))
def test_shape_and_untrained_zero(name):
    values = torch.rand(8, 6, generator=torch.Generator().manual_seed(0))
    trained = torch.tensor([F, T, T, T, F])
    adv = ADVANTAGES[name](values, torch.arange(8) // 4, trained)
    assert adv.shape == (8, 5)
    assert torch.equal(adv[:, ~trained], torch.zeros(8, 2))
    assert adv.abs().max() <= 5.0 and not adv.isnan().any()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="trained"):
        ADVANTAGES["dense"](torch.zeros(2, 4), torch.tensor([0, 0]), torch.tensor([T, T]))
    with pytest.raises(ValueError, match="group"):
        ADVANTAGES["dense"](torch.zeros(2, 4), torch.tensor([0]), torch.tensor([T, T, T]))


# issue 54: a zero gain is not "against the trend", so the step after it is no turning point.
# Z: d = [0, .2, .2, 0], Δ = V_4 − V_0 = +.4, s = [0, +, +, 0]: s_0 = 0 is not < 0, so step 1 is no TP
#    (constrained it would pass: sign(d_1) = sign(V_4 − V_2) = +).
# A: d = [−.1, .3, .2, 0], Δ = +.4, s = [−, +, +, 0]: step 1 is a TP (consistent: V_4 − V_2 = +.2),
#    agg = V_4 − V_1 = .5.  F: flat, never a TP.
ZERO_GAIN = _t([[0.5, 0.5, 0.7, 0.9, 0.9], [0.5, 0.4, 0.7, 0.9, 0.9], [0.5, 0.5, 0.5, 0.5, 0.5]])


@pytest.mark.parametrize("constrained", [True, False])
def test_a_zero_gain_before_a_with_trend_gain_is_no_turning_point(constrained):
    tp = turning_points(ZERO_GAIN, torch.tensor([T, T, T, T]), constrained=constrained)
    expected = torch.zeros(3, 4, dtype=torch.bool)
    expected[1, 1] = True  # A alone; Z's step 1 follows a zero gain
    assert torch.equal(tp, expected)


def test_a_zero_gain_keeps_its_successors_step_reward():
    adv = ADVANTAGES["turning_point"](ZERO_GAIN, torch.tensor([0, 0, 0]), torch.tensor([T, T, T, T]))
    # step 1 rewards [d .2 (Z), agg .5 (A), 0 (F)]: mean 7/30, std √(114/2700) = .2054805
    # → z = [−1/30, 8/30, −7/30] / .2055805 (had Z's step 1 been a TP: [.4, .5, 0] → [.463, .925, −1.388])
    torch.testing.assert_close(adv[:, 1], _t([-0.1621425, 1.2971401, -1.1349976]), rtol=0, atol=1e-5)


# issue 54: the trend is V_N − V_w from the window's start w, not V_0. Window = steps 2, 3, 4.
# P: V = [.9, .7, .3, .2, .5, .6], d = [−.2, −.4, −.1, .3, .1]; Δ = V_5 − V_2 = +.3 (but V_5 − V_0 = −.3)
#    s = [−, +, +] on steps 2, 3, 4: step 3 is a TP (consistent: V_5 − V_4 = +.1), agg = V_5 − V_3 = .4;
#    step 2 is none (constrained: sign(d_2) = − ≠ sign(V_5 − V_3) = +; unconstrained: s_2 < 0).
#    Measured from V_0 the signs would be s = [+, −, −]: no TP at 3, and unconstrained a TP at 2.
# Q: d = [0, 0, 0, .1, 0]: s_2 = 0, no TP.  F: flat.
LATE_WINDOW = _t(
    [[0.9, 0.7, 0.3, 0.2, 0.5, 0.6], [0.5, 0.5, 0.5, 0.5, 0.6, 0.6], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]
)
LATE_TRAINED = torch.tensor([F, F, T, T, T])


@pytest.mark.parametrize("constrained", [True, False])
def test_the_trend_is_measured_from_the_windows_start(constrained):
    tp = turning_points(LATE_WINDOW, LATE_TRAINED, constrained=constrained)
    expected = torch.zeros(3, 5, dtype=torch.bool)
    expected[0, 3] = True
    assert torch.equal(tp, expected)


def test_a_late_window_turning_point_gets_its_aggregated_reward():
    adv = ADVANTAGES["turning_point"](LATE_WINDOW, torch.tensor([0, 0, 0]), LATE_TRAINED)
    # step 3 rewards [agg .4 (P), d .1 (Q), 0 (F)]: mean 1/6, std √(.0866667/3) = .1699673
    # → z = [.2333333, −.0666667, −.1666667] / .1700673 (with P's d .3 instead: [1.335, −.267, −1.068])
    torch.testing.assert_close(adv[:, 3], _t([1.3720057, -0.3920016, -0.9800041]), rtol=0, atol=1e-5)
    assert torch.equal(adv[:, :2], torch.zeros(3, 2))
