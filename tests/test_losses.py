import pytest
import torch
from torch.distributions import Normal, kl_divergence

from flowcredit.losses import approx_kl, clipfrac, clipped_surrogate, gaussian_kl, kl_to_reference


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]])
    logp = torch.randn(2, 3)
    assert clipped_surrogate(logp, logp, adv, 1e-4).item() == pytest.approx(-adv.mean().item())


@pytest.mark.parametrize(
    "r,a,expected",
    [
        (1.5, 1.0, -1.2),  # max(−1.5, −1.2): clipped
        (1.5, -1.0, 1.5),  # max(1.5, 1.2): pessimistic, unclipped
        (0.5, 1.0, -0.5),  # max(−0.5, −0.8): unclipped
        (0.5, -1.0, 0.8),  # max(0.5, 0.8): clipped
        (1.1, 2.0, -2.2),  # inside [0.8, 1.2]: no clipping
    ],
)
def test_clipping_only_outside_the_range(r, a, expected):
    logp_new = torch.log(torch.tensor([r]))
    loss = clipped_surrogate(logp_new, torch.zeros(1), torch.tensor([a]), 0.2)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_gaussian_kl_matches_torch_distributions():
    gen = torch.Generator().manual_seed(0)
    mean, ref = torch.randn(3, 2, 4, generator=gen), torch.randn(3, 2, 4, generator=gen)
    std = torch.tensor([0.3, 0.7, 1.5])
    s = std.view(-1, 1, 1).expand_as(mean)
    expected = kl_divergence(Normal(mean, s), Normal(ref, s)).mean(dim=(1, 2))
    torch.testing.assert_close(gaussian_kl(mean, ref, std), expected)
    assert torch.equal(gaussian_kl(mean, mean, std), torch.zeros(3))


def test_flow_grpo_kl_mode_divides_by_g_squared():
    mean, ref = torch.ones(2, 3), torch.zeros(2, 3)
    std, dt = torch.tensor([0.2, 0.4]), -0.25  # g = std/√0.25 = 2·std
    got = kl_to_reference(mean, ref, std, dt, mode="flow_grpo")
    torch.testing.assert_close(got, 1.0 / (2 * (2 * std) ** 2))
    with pytest.raises(ValueError, match="kl_mode"):
        kl_to_reference(mean, ref, std, dt, mode="approx")


def test_statistics_hand_values():
    logp_old = torch.zeros(4)
    logp_new = torch.log(torch.tensor([1.0, 1.05, 0.5, 1.3]))
    assert clipfrac(logp_new, logp_old, 0.1).item() == pytest.approx(0.5)
    expected = 0.5 * (torch.log(torch.tensor([1.05, 0.5, 1.3])) ** 2).sum().item() / 4
    assert approx_kl(logp_new, logp_old).item() == pytest.approx(expected)
