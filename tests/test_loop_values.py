"""The state values a real iteration computes equal an independent completion of each state (issue
28, item 2): the test's own loop over rows, each row's own prompt encoded alone, the estimator's own
steps written out here, then the row's reward; copied states equal the completion they stand for, and
anchored states equal the sampled image's reward.

The tiny model's velocity depends on the prompt and the reward (``prompt_channel``) too, so a value
completed or scored with another row's prompt differs (checked: the shuffled-prompt values are far).
"""

from __future__ import annotations

import math

import pytest
import torch
from loop_probes import perturb_lora, record_iteration, small_session
from reward_fixtures import prompt_channel

from flowcredit.run.rollout import needed_states

CASES = {
    # TP-GRPO (cps, ode_remaining), window 1–2 of 5: V_1, V_2 completed; step 3 (cps's last) and 4
    # are deterministic, so V_3 = V_4 = V_5 are copies along the schedule
    "ode_remaining": ("tp_grpo", dict(window_start=1, window_size=2)),
    # Stepwise (ddim_sde, euler(3)), window 1–2 of 5: V_1, V_2 completed by 3 Euler sub-steps to 0;
    # V_3's remaining steps are all ODE steps: anchored, V_3 = V_5 (the sampled image's reward)
    "euler": ("stepwise_grpo", dict(window_start=1, window_size=2, substeps=3)),
}


def path_of(estimator: str, sigmas: torch.Tensor, i: int, substeps: int) -> list[float]:
    """The σ sequence the completion of state i walks, written out independently of values.py."""
    n = len(sigmas) - 1
    if estimator == "ode_remaining":
        return sigmas[i:].tolist()
    s = sigmas[i].item()
    return [s * (substeps - j) / substeps for j in range(substeps + 1)] if i < n else [s]


@torch.no_grad()
def complete_alone(model, x, prompt: str, path: list[float]) -> torch.Tensor:
    """Euler along ``path`` for one row ``x (C, H, W)`` with its own prompt, one model call per step."""
    cond = model.encode([prompt])
    for sigma, sigma_next in zip(path[:-1], path[1:]):
        v = model.velocity(x[None], torch.tensor([sigma]), cond)[0].float()
        x = x + (sigma_next - sigma) * v
    return x


def independent_values(s, ro, prompts_of_rows, estimator, anchored_from, states):
    """``(B, N + 1)`` values of ``states`` (a list of indices), NaN elsewhere; states ≥
    ``anchored_from`` take the final image's reward (anchoring)."""
    b, n = ro.logp.shape
    out = torch.full((b, n + 1), math.nan)
    for r in range(b):
        prompt = prompts_of_rows[r]
        for i in states:
            start = n if i >= anchored_from else i
            path = path_of(estimator, s.sigmas, start, 3)
            clean = complete_alone(s.model, ro.states[r, start], prompt, path)
            out[r, i] = prompt_channel(s.model.decode(clean[None]), [prompt], [{}])[0]
    return out


@pytest.mark.parametrize("estimator", sorted(CASES))
def test_state_values_equal_independent_completions(estimator, tmp_path, monkeypatch):
    preset, extra = CASES[estimator]
    s = small_session(preset, tmp_path / "run", reward="reward_fixtures:prompt_channel", **extra)
    assert s.cfg.estimator == estimator
    batch = s.draw(0)
    assert len(set(batch.prompts)) > 1  # two groups, two prompts (seed 0)
    perturb_lora(s)  # a policy away from the base model: values must use the current policy
    seen, _ = record_iteration(s, monkeypatch)
    ro, values = seen["ro"], seen["values"]
    s.policy.load_trainable_state(seen["policy_before_update"])  # the policy the values were taken with
    rows_prompts = [batch.prompts[g] for g in batch.group.tolist()]
    anchored_from = 3 if estimator == "euler" else s.cfg.num_steps + 1
    need = needed_states(s.credit.needs, s.trained)  # (N + 1,)
    present = ~torch.isnan(values).any(dim=0)  # (N + 1,): needed ones, and copies along the chain
    assert (present | ~need).all() and (~torch.isnan(values[:, present])).all()
    states = torch.nonzero(present, as_tuple=True)[0].tolist()
    assert len(states) >= 4  # completed, copied / anchored, and V_N
    want = independent_values(s, ro, rows_prompts, estimator, anchored_from, states)
    torch.testing.assert_close(values[:, states], want[:, states], atol=2e-5, rtol=1e-4)
    need = torch.zeros_like(values, dtype=torch.bool)
    need[:, states] = True

    # the check can fail: the same completions with the prompts of the other group are far off
    swapped = [batch.prompts[1 - g] for g in batch.group.tolist()]
    wrong = independent_values(s, ro, swapped, estimator, anchored_from, states)
    completed = need.clone()
    completed[:, -1] = False  # V_N of the swapped prompt differs by the reward's channel only
    assert (values[completed] - wrong[completed]).abs().max() > 100 * 2e-5
