import pytest
import torch

from flowcredit.calibration import calibrate, update_psi


def test_update_psi_hand_case():
    psi = torch.tensor([0.5, 0.5, 0.5, 0.01])
    d = torch.tensor(
        [
            [0.1, 0.2, 0.3, -0.1],
            [0.2, 0.1, 0.3, -0.1],
            [-0.1, 0.3, -0.3, -0.1],
            [-0.3, -0.1, -0.3, 0.2],
        ]
    )
    trained = torch.tensor([True, True, False, True])
    # step 0: P=2, Q=2 → balanced → +0.01; step 1: P=3, Q=1, |2| ≥ 2 → −0.01;
    # step 2: untrained → unchanged; step 3: P=1, Q=3 → −0.01 but clamped at 0.01
    expected = torch.tensor([0.51, 0.49, 0.5, 0.01])
    torch.testing.assert_close(update_psi(psi, d, trained), expected)


def test_zeros_count_for_neither_sign():
    d = torch.tensor([[0.0], [0.0], [0.0], [1.0]])  # P = 1, Q = 0 → balanced
    assert update_psi(torch.tensor([0.2]), d, torch.tensor([True])).item() == pytest.approx(0.21)


def synthetic_step_rewards(threshold: torch.Tensor, batch: int = 16):
    """Signs balanced (8/8) while ψ_i < τ_i, then mostly negative (2/14): ψ_i should settle at τ_i."""

    def sample(psi):
        balanced = torch.tensor([1.0] * 8 + [-1.0] * 8)
        skewed = torch.tensor([1.0] * 2 + [-1.0] * 14)
        cols = [balanced if p < t else skewed for p, t in zip(psi.tolist(), threshold.tolist())]
        return torch.stack(cols, dim=1)[:batch]

    return sample


def test_driver_converges_to_the_sign_balance_threshold():
    threshold = torch.tensor([0.5, 0.35, 0.2, 0.3])
    trained = torch.tensor([True, True, True, False])
    res = calibrate(synthetic_step_rewards(threshold), torch.full((4,), 0.3), trained, max_iters=200)
    assert res.converged and res.iterations < 40
    assert (res.psi[:3] - threshold[:3]).abs().max().item() <= 0.02 + 1e-6
    assert res.psi[3].item() == torch.tensor(0.3).item()  # untrained: untouched
    assert len(res.history) == res.iterations + 1


def test_driver_stops_at_cap():
    never_balanced = lambda psi: torch.ones(16, psi.numel())
    res = calibrate(never_balanced, torch.full((2,), 5.0), torch.tensor([True, True]), max_iters=3)
    assert not res.converged and res.iterations == 3
    torch.testing.assert_close(res.psi, torch.full((2,), 4.97))
