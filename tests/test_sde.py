"""Samplers against independent computations: torch.distributions densities, hand values, and
closed-form marginals of an analytic rectified-flow velocity."""

import math

import pytest
import torch
from torch.distributions import Normal

from flowcredit.sde import DEFAULT_LEVELS, SAMPLERS

STOCHASTIC = ["flow_sde", "dance_sde", "cps", "ddim_sde"]


def _inputs(b=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(b, 2, 4, 4, generator=gen)
    x = torch.randn(b, 2, 4, 4, generator=gen)
    return v, x


@pytest.mark.parametrize("name", STOCHASTIC)
def test_logp_is_normal_density_averaged_over_dims(name):
    v, x = _inputs()
    out = SAMPLERS[name](v, x, 0.6, 0.5, DEFAULT_LEVELS[name], generator=torch.Generator().manual_seed(1))
    std = out.std.view(-1, 1, 1, 1).expand_as(out.mean)
    expected = Normal(out.mean, std).log_prob(out.x_next).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.logp, expected, rtol=1e-5, atol=1e-5)
    assert out.std.shape == (3,) and out.logp.shape == (3,)


@pytest.mark.parametrize("name", STOCHASTIC)
def test_rescoring_reproduces_logp_and_mean(name):
    v, x = _inputs()
    step = SAMPLERS[name]
    out = step(v, x, 0.8, 0.6, DEFAULT_LEVELS[name], generator=torch.Generator().manual_seed(2))
    again = step(v, x, 0.8, 0.6, DEFAULT_LEVELS[name], x_next=out.x_next)
    assert torch.equal(again.mean, out.mean) and torch.equal(again.logp, out.logp)
    assert torch.equal(again.x_next, out.x_next)


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_zero_noise_is_the_euler_step(name):
    v, x = _inputs()
    out = SAMPLERS[name](v, x, 0.7, 0.4, 0.0)
    torch.testing.assert_close(out.x_next, x + (0.4 - 0.7) * v, rtol=0, atol=1e-6)
    assert torch.equal(out.std, torch.zeros(3)) and torch.equal(out.logp, torch.zeros(3))


@pytest.mark.parametrize("name", STOCHASTIC)
def test_per_sample_sigma_equals_row_by_row(name):
    v, x = _inputs(b=4)
    sigma = torch.tensor([1.0, 0.8, 0.5, 0.3])
    sigma_next = torch.tensor([0.9, 0.6, 0.45, 0.1])
    level = torch.tensor([0.7, 0.5, 0.3, 0.9])
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    batch = SAMPLERS[name](v, x, sigma, sigma_next, level, noise=noise)
    for b in range(4):
        row = SAMPLERS[name](
            v[b : b + 1],
            x[b : b + 1],
            sigma[b].item(),
            sigma_next[b].item(),
            level[b].item(),
            noise=noise[b : b + 1],
        )
        torch.testing.assert_close(batch.x_next[b : b + 1], row.x_next, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batch.logp[b : b + 1], row.logp, rtol=1e-6, atol=1e-6)


def _scalar_step(name, sigma, sigma_next, level):
    v, x = torch.full((1, 1), 0.5), torch.ones(1, 1)
    return SAMPLERS[name](v, x, sigma, sigma_next, level, noise=torch.zeros(1, 1))


def test_flow_sde_hand_values():
    # x = 1, v = 0.5, σ = 0.5, σ' = 0.25, a = 0.7: g = 0.7·√(0.5/0.5) = 0.7
    # mean = 1 − 0.25·[0.5 + 0.49/(2·0.5)·(1 + 0.5·0.5)] = 0.721875; std = 0.7·√0.25 = 0.35
    out = _scalar_step("flow_sde", 0.5, 0.25, 0.7)
    assert out.mean.item() == pytest.approx(0.721875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.35, abs=1e-6)
    # at σ = 1, σ̃ = σ' = 0.8: g = 0.7·√(1/0.2) = 1.5652476, std = g·√0.2
    first = _scalar_step("flow_sde", 1.0, 0.8, 0.7)
    assert first.std.item() == pytest.approx(1.5652476 * math.sqrt(0.2), abs=1e-5)


def test_dance_sde_hand_values():
    out = _scalar_step("dance_sde", 0.5, 0.25, 0.7)  # g = level = 0.7: same as the flow case above
    assert out.mean.item() == pytest.approx(0.721875, abs=1e-6)
    assert out.std.item() == pytest.approx(0.35, abs=1e-6)


def test_cps_and_ddim_hand_values():
    # x̂0 = 1 − 0.5·0.5 = 0.75, x̂1 = 1 + 0.5·0.5 = 1.25
    cps = _scalar_step("cps", 0.5, 0.25, 0.7)  # s = 0.25·sin(0.35π) = 0.2227516
    assert cps.std.item() == pytest.approx(0.2227516, abs=1e-6)
    assert cps.mean.item() == pytest.approx(0.7043720, abs=1e-6)
    ddim = _scalar_step("ddim_sde", 0.5, 0.25, 0.7)  # s = 0.7·0.25·√0.5 = 0.1237437
    assert ddim.std.item() == pytest.approx(0.1237437, abs=1e-6)
    assert ddim.mean.item() == pytest.approx(0.8340335, abs=1e-6)


@pytest.mark.parametrize("name", ["cps", "ddim_sde"])
def test_last_step_is_deterministic(name):
    v, x = _inputs()
    out = SAMPLERS[name](v, x, 0.2, 0.0, 0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out.std, torch.zeros(3)) and torch.equal(out.logp, torch.zeros(3))
    torch.testing.assert_close(out.x_next, x - 0.2 * v)


def test_cps_mse_surrogate_is_named_option_not_default():
    v, x = _inputs()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    default = SAMPLERS["cps"](v, x, 0.6, 0.4, 0.7, noise=noise)
    mse = SAMPLERS["cps"](v, x, 0.6, 0.4, 0.7, noise=noise, logp_mode="cps_mse")
    torch.testing.assert_close(mse.logp, -((default.x_next - default.mean) ** 2).mean(dim=(1, 2, 3)))
    assert not torch.allclose(mse.logp, default.logp)
    with pytest.raises(ValueError, match="logp_mode"):
        SAMPLERS["cps"](v, x, 0.6, 0.4, 0.7, noise=noise, logp_mode="mse")


def test_given_noise_and_fp32_under_bf16_inputs():
    v, x = _inputs()
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    out = SAMPLERS["flow_sde"](v.bfloat16(), x.bfloat16(), 0.6, 0.5, 0.7, noise=noise)
    assert out.x_next.dtype == torch.float32 and out.logp.dtype == torch.float32
    torch.testing.assert_close(out.x_next, out.mean + out.std.view(-1, 1, 1, 1) * noise)


# ---- distributional correctness with the exact velocity of Gaussian data ----


def gaussian_velocity(mu: torch.Tensor, c: float):
    """Exact rectified-flow velocity E[ε − x0 | x_σ] for x0 ~ N(μ, c²I), ε ~ N(0, I).

    x_σ ~ N((1−σ)μ, ((1−σ)²c² + σ²)I); E[x0|x] = μ + (1−σ)c²/var·(x − m), E[ε|x] = σ/var·(x − m).
    """

    def velocity(x, sigma):
        s = sigma.view(-1, *([1] * (x.ndim - 1)))
        m = (1 - s) * mu
        var = (1 - s) ** 2 * c**2 + s**2
        return (s - (1 - s) * c**2) / var * (x - m) - mu

    return velocity


def _sample(name, level, velocity, num_steps, n, dim, seed, shift=1.0, keep=False):
    from flowcredit.schedule import sigmas as make_sigmas

    sig = make_sigmas(num_steps, shift)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen)
    states = [x]
    for i in range(num_steps):
        s = torch.full((n,), sig[i].item())
        x = SAMPLERS[name](velocity(x, s), x, sig[i].item(), sig[i + 1].item(), level, generator=gen).x_next
        states.append(x)
    return (states, sig) if keep else x


@pytest.mark.parametrize("name,level", [("ode", 0.0), ("flow_sde", 0.7), ("dance_sde", 0.3)])
def test_gaussian_data_is_reached_by_marginal_preserving_samplers(name, level):
    # Tolerance: |mean − μ| < 0.05 and |var/c² − 1| < 0.08 with 8,000 points, 100 steps.
    mu, c = torch.tensor([0.5, -1.0]), 0.5
    x = _sample(name, level, gaussian_velocity(mu, c), num_steps=100, n=8000, dim=2, seed=0)
    assert (x.mean(0) - mu).abs().max().item() < 0.05
    assert (x.var(0) / c**2 - 1).abs().max().item() < 0.08


@pytest.mark.parametrize("name", ["cps", "ddim_sde"])
def test_coefficient_preserving_samplers_shrink_variance_of_spread_data(name):
    """CPS and the DDIM-like SDE re-noise a fixed fraction of σ' per step (not ∝ √(−dt)), around
    x̂0 = E[x0 | x]: exact for a point mass (next test), but for spread data the final variance is
    below c² and more so at a higher level; the mean stays right. Measured (100 steps, 8,000 points):
    cps α=0.7 → var/c² ≈ 0.69, α=0.3 → ≈ 0.92; ddim_sde η=0.7 → ≈ 0.85. See docs/algorithms.md."""
    mu, c = torch.tensor([0.5, -1.0]), 0.5
    ratios = []
    for level in (0.1, 0.7):
        x = _sample(name, level, gaussian_velocity(mu, c), num_steps=100, n=8000, dim=2, seed=0)
        assert (x.mean(0) - mu).abs().max().item() < 0.05
        ratios.append((x.var(0) / c**2).mean().item())
    assert 0.9 < ratios[0] < 1.08  # little noise: close to the ODE
    assert 0.6 < ratios[1] < ratios[0] - 0.05  # more noise: measurably under-dispersed


@pytest.mark.parametrize("name", ["cps", "ddim_sde"])
def test_point_mass_marginals_exact_with_four_steps(name):
    mu = torch.tensor([0.7, -0.3, 1.5])
    states, sig = _sample(
        name, 0.7, gaussian_velocity(mu, 0.0), num_steps=4, n=20000, dim=3, seed=1, keep=True
    )
    for x, s in zip(states[1:], sig[1:].tolist()):
        assert (x.mean(0) - (1 - s) * mu).abs().max().item() < 0.03
        if s > 0:
            assert (x.std(0) / s - 1).abs().max().item() < 0.03
        else:
            assert (x - mu).abs().max().item() < 1e-5
