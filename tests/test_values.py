import pytest
import torch

from flowcredit.schedule import sigmas as make_sigmas
from flowcredit.sde import SAMPLERS
from flowcredit.values import complete


class CountingVelocity:
    """A nonlinear analytic velocity that records the batch size of every call."""

    def __init__(self):
        self.batch_sizes = []

    def __call__(self, x, sigma):
        self.batch_sizes.append(x.shape[0])
        s = sigma.view(-1, 1, 1)
        return torch.tanh(x) * (1 + s) + s**2


def _per_row_ode(velocity, x, sig, start):
    out = []
    for b in range(x.shape[0]):
        xb = x[b : b + 1]
        for i in range(int(start[b]), sig.numel() - 1):
            v = velocity(xb, sig[i].view(1))
            xb = xb + (sig[i + 1] - sig[i]) * v
        out.append(xb)
    return torch.cat(out)


def test_ode_remaining_lockstep_equals_per_row_loop_and_counts_calls():
    sig = make_sigmas(6, shift=2.0)
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(0))
    start = torch.tensor([0, 3, 5, 6])
    vel = CountingVelocity()
    got = complete(vel, x, sig, start, "ode_remaining")
    assert len(vel.batch_sizes) == 6  # max(N − start) calls
    assert vel.batch_sizes == [3, 2, 2, 1, 1, 1]  # every call covers all rows still running
    torch.testing.assert_close(got, _per_row_ode(CountingVelocity(), x, sig, start), rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], x[3])  # start = N: the state itself


def test_ode_remaining_from_start_zero_is_the_ode_sampler():
    sig = make_sigmas(5)
    x = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(1))
    vel = CountingVelocity()
    ref = x
    for i in range(5):
        ref = SAMPLERS["ode"](vel(ref, sig[i].expand(3)), ref, sig[i].item(), sig[i + 1].item()).x_next
    torch.testing.assert_close(complete(vel, x, sig, torch.zeros(3, dtype=torch.long)), ref)


def test_euler_substeps_per_row_and_call_count():
    sig = make_sigmas(8)
    x = torch.randn(3, 2, 3, generator=torch.Generator().manual_seed(2))
    start = torch.tensor([1, 4, 8])
    vel = CountingVelocity()
    got = complete(vel, x, sig, start, "euler", substeps=3)
    assert vel.batch_sizes == [2, 2, 2]
    for b in range(2):  # hand loop: 3 equal steps from σ_start to 0
        xb, s0 = x[b : b + 1], sig[start[b]].item()
        grid = [s0 * (1 - j / 3) for j in range(4)]
        for j in range(3):
            xb = xb + (grid[j + 1] - grid[j]) * CountingVelocity()(xb, torch.tensor([grid[j]]))
        torch.testing.assert_close(got[b : b + 1], xb, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[2], x[2])


def test_euler_one_step_is_tweedie_estimate():
    sig = make_sigmas(4)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([0, 1, 2, 3])
    vel = lambda x, s: x * s.view(-1, 1) + 1.0
    expected = x - sig[start].view(-1, 1) * vel(x, sig[start])
    torch.testing.assert_close(complete(vel, x, sig, start, "euler", substeps=1), expected)


def test_bad_inputs_raise():
    sig = make_sigmas(4)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="estimator"):
        complete(lambda x, s: x, x, sig, torch.tensor([0, 1]), "rk4")
    with pytest.raises(ValueError, match="start"):
        complete(lambda x, s: x, x, sig, torch.tensor([0, 5]))
