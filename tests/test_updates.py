"""Update rules (flowcredit.updates): hand-computed losses on 2×1×1×2 tensors, gradient directions by
autograd, an independent formulation of each (the authors' form), the time draws. The registry:
test_update_registry.py."""

from __future__ import annotations

import math

import pytest
import torch

from flowcredit import updates
from flowcredit.losses import clipped_surrogate
from flowcredit.schedule import sigmas
from flowcredit.sde import gaussian_logp
from flowcredit.updates import (
    awm,
    awm_times,
    matching_error,
    nft,
    nft_optimality,
    nft_times,
    noised,
    normalized_log_ratio,
    ratio_norm,
    soft_update_decay,
    velocity_kl,
)


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _lat(rows):
    """Rows of two latent values as a (B, 1, 1, 2) tensor."""
    return _t(rows).view(-1, 1, 1, 2)


# The shared forward-process example (B = 2, latents 1×1×2):
CLEAN = _lat([[1.0, -1.0], [0.5, 2.0]])
NOISE = _lat([[0.0, 2.0], [-1.0, 1.0]])
T = _t([0.25, 0.5])
V_THETA = _lat([[0.0, 2.0], [-1.0, 0.0]])  # target ε − x̂ = [[−1, 3], [−1.5, −1]]: diff [[1, −1], [.5, 1]]
V_OLD = _lat([[0.5, 1.5], [-1.0, 0.5]])
ADV = _t([5.0, -2.5])  # / adv_scale 5 → â = [1, −0.5]


def test_forward_process_and_matching_error_by_hand():
    # x_t = (1 − t)·clean + t·ε: row 0 .75·[1, −1] + .25·[0, 2]; row 1 .5·[.5, 2] + .5·[−1, 1]
    torch.testing.assert_close(noised(CLEAN, NOISE, T), _lat([[0.75, -0.25], [-0.25, 1.5]]))
    # mean_d (v − (ε − x̂))²: row 0 (1 + 1)/2, row 1 (.25 + 1)/2
    torch.testing.assert_close(matching_error(V_THETA, CLEAN, NOISE), _t([1.0, 0.625]))
    # mean_d (v − v_old)²: row 0 (.25 + .25)/2, row 1 (0 + .25)/2
    torch.testing.assert_close(velocity_kl(V_THETA, V_OLD), _t([0.25, 0.125]))


# --- AWM ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weighting,expected",
    [
        ("uniform", 0.34375),  # (1·1 − .5·.625)/2
        ("t", 0.046875),  # (1·.25·1 − .5·.5·.625)/2
        ("t2", -0.0078125),  # (1·.0625·1 − .5·.25·.625)/2
        # t·((err + 1e-10)^¼ − 1e-10^¼)/¼, 1e-10^¼ = 0.0031622777:
        # row 0: .25·4·(1 − .0031623) = .99683772; row 1: .5·4·(.625^¼ − .0031623) = 1.77195485
        ("ghuber", 0.05543015),  # (.99683772 − .5·1.77195485)/2
    ],
)
def test_awm_loss_by_hand(weighting, expected):
    loss = awm(V_THETA, V_OLD, CLEAN, NOISE, T, ADV, weighting=weighting, old_beta=0.0)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_awm_old_policy_anchor_by_hand():
    base = awm(V_THETA, V_OLD, CLEAN, NOISE, T, ADV, weighting="uniform", old_beta=0.0)
    anchored = awm(V_THETA, V_OLD, CLEAN, NOISE, T, ADV, weighting="uniform", old_beta=2.0)
    assert (anchored - base).item() == pytest.approx(2.0 * (0.25 + 0.125) / 2)  # 2·mean(KL_v)


def test_awm_gradient_by_hand_and_step_direction():
    v = V_THETA.clone().requires_grad_(True)
    awm(v, V_OLD, CLEAN, NOISE, T, ADV, weighting="uniform", old_beta=0.0).backward()
    # ∂/∂v of mean_b â_b·mean_d (v − target)² = â_b·2·(v − target)/(D·B), D = B = 2
    torch.testing.assert_close(v.grad, _lat([[0.5, -0.5], [-0.125, -0.25]]))
    with torch.no_grad():
        stepped = v - 0.1 * v.grad
    before, after = matching_error(V_THETA, CLEAN, NOISE), matching_error(stepped, CLEAN, NOISE)
    assert after[0] < before[0]  # positive advantage: the sample's matching error goes down
    assert after[1] > before[1]  # negative advantage: up


@pytest.mark.parametrize("weighting", updates.AWM_WEIGHTINGS)
def test_awm_gradient_equals_the_authors_ratio_form(weighting):
    """Their code: PPO surrogate of r = exp(ℓ_old − ℓ) with ℓ_old = ℓ detached (r ≡ 1), clip range 1."""
    v1 = V_THETA.clone().requires_grad_(True)
    awm(v1, V_OLD, CLEAN, NOISE, T, ADV, weighting=weighting, old_beta=0.0).backward()
    v2 = V_THETA.clone().requires_grad_(True)
    ell = updates.awm_weighted_error(matching_error(v2, CLEAN, NOISE), T, weighting, 0.25)
    clipped_surrogate(-ell, -ell.detach(), (ADV / 5.0).clamp(-1, 1), 1.0).backward()
    torch.testing.assert_close(v1.grad, v2.grad)


# --- DiffusionNFT ------------------------------------------------------------------------------


def test_nft_optimality_probability():
    adv = _t([10.0, 5.0, 2.5, 0.0, -1.0, -7.0])
    torch.testing.assert_close(nft_optimality(adv, 5.0), _t([1.0, 1.0, 0.75, 0.5, 0.4, 0.0]))


@pytest.mark.parametrize(
    "weighting,expected",
    [
        # β = 1: v⁺ = v_θ, v⁻ = 2·v_old − v_θ = [[1, 1], [−1, 1]]; r = [1, .25]
        # uniform: row 0 L⁺ = 1, L⁻ = (4 + 4)/2 = 4 → 1; row 1 L⁺ = .625, L⁻ = (.25 + 4)/2 = 2.125
        #   → .25·.625 + .75·2.125 = 1.75;  (Z/β)·mean = 5·(1 + 1.75)/2
        ("uniform", 6.875),
        # adaptive: t·mean_d diff²/mean_d |diff|: row 0 L⁺ = .25·1/1 = .25 (r = 1);
        #   row 1 L⁺ = .5·.625/.75 = .4166667, L⁻ = .5·2.125/1.25 = .85 → .1041667 + .6375 = .7416667
        ("adaptive", 2.4791667),  # 5·(.25 + .7416667)/2
    ],
)
def test_nft_loss_by_hand(weighting, expected):
    loss = nft(V_THETA, V_OLD, CLEAN, NOISE, T, ADV, beta=1.0, weighting=weighting)
    assert loss.item() == pytest.approx(expected, abs=1e-5)


def _nft_as_in_their_code(v_theta, v_old, clean, noise, t, adv, beta, z=5.0):
    """The authors' form: x0-predictions from x_t, self-normalised by sg(mean |x̂0 − x0|)."""
    tt = t.view(-1, 1, 1, 1)
    x_t = (1 - tt) * clean + tt * noise
    r = ((adv.clamp(-z, z) / z) / 2.0 + 0.5).clamp(0, 1)
    out = []
    for v in (beta * v_theta + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_theta):
        x0_pred = x_t - tt * v
        weight = (x0_pred - clean).abs().mean(dim=(1, 2, 3), keepdim=True).clip(min=1e-5).detach()
        out.append(((x0_pred - clean) ** 2 / weight).mean(dim=(1, 2, 3)))
    return ((r * out[0] / beta + (1 - r) * out[1] / beta) * z).mean()


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_equals_the_authors_x0_form_value_and_gradient(beta):
    gen = torch.Generator().manual_seed(0)
    clean, noise = torch.randn(4, 2, 3, 3, generator=gen), torch.randn(4, 2, 3, 3, generator=gen)
    v_old, t = torch.randn(4, 2, 3, 3, generator=gen), torch.rand(4, generator=gen)
    v0, adv = v_old + 0.1 * torch.randn(4, 2, 3, 3, generator=gen), _t([7.0, 2.0, -1.0, -3.0])
    v1, v2 = v0.clone().requires_grad_(True), v0.clone().requires_grad_(True)
    ours = nft(v1, v_old, clean, noise, t, adv, beta=beta)
    theirs = _nft_as_in_their_code(v2, v_old, clean, noise, t, adv, beta)
    torch.testing.assert_close(ours, theirs)
    ours.backward(), theirs.backward()
    torch.testing.assert_close(v1.grad, v2.grad)


@pytest.mark.parametrize("weighting", updates.NFT_WEIGHTINGS)
def test_nft_gradient_at_the_old_policy_moves_toward_the_target_iff_r_above_half(weighting):
    adv = _t([2.5, -2.5])  # r = [.75, .25]
    v = V_OLD.clone().requires_grad_(True)
    nft(v, V_OLD, CLEAN, NOISE, T, adv, beta=0.1, weighting=weighting).backward()
    if weighting == "uniform":  # v⁺ = v⁻ = v_old: ∇ = (Z/B)·(2r − 1)·2·(v_old − target)/D
        target = NOISE - CLEAN
        expected = 5.0 / 2 * _t([0.5, -0.5]).view(-1, 1, 1, 1) * (V_OLD - target)
        torch.testing.assert_close(v.grad, expected)
    with torch.no_grad():
        stepped = v - 0.01 * v.grad
    before, after = matching_error(V_OLD, CLEAN, NOISE), matching_error(stepped, CLEAN, NOISE)
    assert after[0] < before[0] and after[1] > before[1]
    v = V_OLD.clone().requires_grad_(True)
    nft(v, V_OLD, CLEAN, NOISE, T, _t([0.0, 0.0]), weighting=weighting).backward()  # r = ½: no signal
    torch.testing.assert_close(v.grad, torch.zeros_like(v))


def test_forward_losses_check_shapes():
    with pytest.raises(ValueError, match="t must be"):
        nft(V_THETA, V_OLD, CLEAN, NOISE, _t([0.5]), ADV)
    with pytest.raises(ValueError, match="v_old must have"):
        awm(V_THETA, V_OLD[:, :, :, :1], CLEAN, NOISE, T, ADV)


# --- GRPO-Guard RatioNorm ----------------------------------------------------------------------

STD = _t([0.5, 0.25])
MEAN_OLD = _lat([[0.0, 0.0], [1.0, 1.0]])
MEAN_NEW = _lat([[0.1, -0.2], [1.05, 1.0]])
EPS = _lat([[1.0, -1.0], [2.0, 0.0]])
X_NEXT = MEAN_OLD + STD.view(-1, 1, 1, 1) * EPS  # [[.5, −.5], [1.5, 1]]


def test_normalized_log_ratio_by_hand():
    logp_new, logp_old = gaussian_logp(X_NEXT, MEAN_NEW, STD), gaussian_logp(X_NEXT, MEAN_OLD, STD)
    # Δlogp = mean_d((x' − μ_old)² − (x' − μ_θ)²)/(2s²): row 0 ([.25, .25] − [.16, .09])/.5 → .25;
    # row 1 ([.25, 0] − [.2025, 0])/.125 → .19.  shift = mean_d Δμ²/(2s²): .025/.5 = .05; .00125/.125 = .01
    torch.testing.assert_close(logp_new - logp_old, _t([0.25, 0.19]))
    ell = normalized_log_ratio(logp_new, logp_old, MEAN_NEW, MEAN_OLD, STD)
    torch.testing.assert_close(ell, _t([0.15, 0.05]))  # (.25 + .05)·.5, (.19 + .01)·.25
    # independent form: mean_d(ε·(μ_θ − μ_old)): (.1 + .2)/2, (.1 + 0)/2
    torch.testing.assert_close(ell, (EPS * (MEAN_NEW - MEAN_OLD)).mean(dim=(1, 2, 3)))


def test_ratio_norm_loss_by_hand():
    logp_new, logp_old = gaussian_logp(X_NEXT, MEAN_NEW, STD), gaussian_logp(X_NEXT, MEAN_OLD, STD)
    loss = ratio_norm(logp_new, logp_old, MEAN_NEW, MEAN_OLD, STD, _t([1.0, -1.0]), clip_range=0.1)
    # r = [e^.15, e^.05] = [1.1618342, 1.0512711]: row 0 (A > 0) clipped to −1.1; row 1 inside → +1.0512711
    assert loss.item() == pytest.approx((-1.1 + math.exp(0.05)) / 2, abs=1e-6)
    same = ratio_norm(logp_old, logp_old, MEAN_OLD, MEAN_OLD, STD, _t([1.0, -3.0]))
    assert same.item() == pytest.approx(1.0)  # same policy: r = 1, loss = −mean(A)


def test_ratio_norm_centres_the_ratio_and_equalises_its_spread_across_steps():
    gen = torch.Generator().manual_seed(0)
    d = torch.full((1, 64), 0.02)  # the same mean shift at two noise levels
    out = {}
    for s in (0.5, 0.05):
        mean_old = torch.zeros(4000, 64)
        x_next = mean_old + s * torch.randn(4000, 64, generator=gen)
        std = torch.full((4000,), s)
        raw = gaussian_logp(x_next, mean_old + d, std) - gaussian_logp(x_next, mean_old, std)
        out[s] = (raw, normalized_log_ratio(raw, torch.zeros(4000), mean_old + d, mean_old, std))
    for s, (raw, ell) in out.items():
        assert raw.mean() < -0.5 * 0.02**2 / (2 * s**2)  # Flow-GRPO's ratio is left-shifted (E = −shift)
        assert abs(ell.mean()) < 3 * ell.std() / math.sqrt(4000)  # RatioNorm: centred on 0
    assert out[0.05][0].std() / out[0.5][0].std() == pytest.approx(10.0, rel=0.1)  # raw spread ∝ 1/s
    assert out[0.05][1].std() / out[0.5][1].std() == pytest.approx(1.0, rel=0.1)  # normalised: equal


def test_ratio_norm_rejects_a_deterministic_step():
    with pytest.raises(ValueError, match="std must be > 0"):
        normalized_log_ratio(_t([0, 0]), _t([0, 0]), MEAN_NEW, MEAN_OLD, _t([0.5, 0.0]))


# --- time draws and the old policy's soft update -----------------------------------------------


def test_awm_times_one_grid_value_per_stratum_shared_by_the_rows():
    grid = sigmas(14, shift=3.0)
    # M = int(14·.9) = 12, edges linspace(1, 12, 7).long() = [1, 2, 4, 6, 8, 10, 12]
    strata = [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    seen = set()
    for seed in range(60):
        t = awm_times(grid, 3, torch.Generator().manual_seed(seed))
        assert t.shape == (6, 3) and torch.equal(t, t[:, :1].expand(6, 3))
        for k, stratum in enumerate(strata):
            (j,) = [j for j in range(15) if grid[j] == t[k, 0]]
            assert j in stratum
            seen.add(j)
    assert seen == set(range(1, 12))  # never σ_0 = 1, never σ_12..σ_14
    first = awm_times(grid, 2, torch.Generator().manual_seed(0), time_from_first=True)
    assert first[0, 0] in (grid[0], grid[1])  # stratum {0, 1}: σ_0 allowed


def test_nft_times_distinct_grid_values_per_row():
    grid = sigmas(10, shift=3.0)
    t = nft_times(grid, 5, torch.Generator().manual_seed(0))
    assert t.shape == (9, 5)  # K = int(10·.99) = 9
    for b in range(5):
        column = t[:, b].tolist()
        assert len(set(column)) == 9 and set(column) <= set(grid[:10].tolist())  # never σ_N = 0
    assert not torch.equal(t[:, 0], t[:, 1])  # rows draw independently


def test_soft_update_decay_schedules():
    nft_default = dict(old_decay_rate=0.001, old_decay_max=0.5)  # DiffusionNFT decay_type 1
    assert [soft_update_decay(k, **nft_default) for k in (0, 100, 1000)] == pytest.approx([0.0, 0.1, 0.5])
    ocr = dict(old_decay_rate=0.0075, old_decay_max=0.999, old_decay_flat=75)  # decay_type 2
    assert [soft_update_decay(k, **ocr) for k in (50, 175, 300)] == pytest.approx([0.0, 0.75, 0.999])
    awm_default = dict(old_decay_rate=0.001, old_decay_max=0.3)  # AWM kl_ema_decay "linear", 0.3
    assert [soft_update_decay(k, **awm_default) for k in (100, 500)] == pytest.approx([0.1, 0.3])
