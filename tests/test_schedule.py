import torch

from flowcredit.schedule import exponential_shift_sigmas, sigmas


def test_plain_schedule_is_linspace():
    assert torch.equal(sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    assert sigmas(4).dtype == torch.float32


def test_shifted_schedule_hand_values():
    # s·σ/(1 + (s−1)σ) with s = 3: 0.75 → 2.25/2.5, 0.5 → 1.5/2, 0.25 → 0.75/1.5
    expected = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0])
    torch.testing.assert_close(sigmas(4, shift=3.0), expected)


def test_endpoints_exact_and_decreasing():
    for shift in (0.5, 1.0, 3.0, 7.0):
        s = sigmas(13, shift)
        assert s[0].item() == 1.0 and s[-1].item() == 0.0
        assert bool((s[1:] < s[:-1]).all())


def test_exponential_shift_at_mu_zero_is_identity():
    s = torch.tensor([1.0, 0.6, 0.2, 0.0])
    torch.testing.assert_close(exponential_shift_sigmas(s, 0.0), s)
