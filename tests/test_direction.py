"""Training moves the policy the right way (issue 28, item 1): for every credit method, one real
iteration of the loop raises the log-probability of its positive-advantage transitions and lowers the
negative ones; the advantages it trains on are the credit function's own on the iteration's values;
and with β > 0 the KL term pulls the policy towards the reference.

Deterministic checks on log-probabilities of recorded transitions, not learning curves.
"""

from __future__ import annotations

import pytest
import torch
from loop_probes import perturb_lora, record_iteration, small_session, transition_logp

from flowcredit.advantages import CREDITS
from flowcredit.run.plans import iteration_plan, sample
from flowcredit.run.rollout import seeded
from flowcredit.train import ppo_update

# each credit method through the preset that uses it (dense: ψ from one calibration round)
CREDIT_PRESETS = {"flow_grpo": "flow_grpo", "dense": "dense_grpo", "stepwise": "stepwise_grpo"}
CREDIT_PRESETS |= {"turning_point": "tp_grpo", "coca": "coca"}


def test_every_built_in_credit_method_is_covered():
    assert set(CREDIT_PRESETS) == set(CREDITS)


@pytest.mark.parametrize("credit", sorted(CREDIT_PRESETS))
def test_an_update_raises_positive_and_lowers_negative_advantage_transitions(credit, tmp_path, monkeypatch):
    from flowcredit.run.calibrate import ensure_psi

    # a small step (lr 1e-4, two epochs): the first-order change follows the advantage; the second-order
    # one, −|Δμ|²/(2s²), lowers every transition's log-density alike and grows as lr²
    s = small_session(CREDIT_PRESETS[credit], tmp_path / "run", lr=1e-4, inner_epochs=2, weight_decay=0.0)
    ensure_psi(s)
    seen, metrics = record_iteration(s, monkeypatch)
    ro, adv, group, keep = seen["ro"], seen["adv"], seen["group"], seen["keep"]
    assert metrics["stats/optimizer_steps"] > 0

    # the advantages trained on are the credit function's on this iteration's values
    want = CREDITS[credit].fn(seen["values"], group, s.trained, **s.credit_kwargs)
    torch.testing.assert_close(adv, want)

    # the update moved each transition's log-density the way its advantage says
    delta = transition_logp(s, ro, seen["prompts"], group) - ro.logp  # (B, N)
    kept = torch.zeros(len(group), dtype=torch.bool)
    kept[keep] = True
    live = kept[:, None] & s.trained[None, :]  # (B, N)
    pos, neg = live & (adv > 0), live & (adv < 0)
    assert pos.sum() >= 4 and neg.sum() >= 4, "too few transitions to judge the direction"
    assert delta[pos].mean() > 0 > delta[neg].mean(), (delta[pos].mean(), delta[neg].mean())
    surrogate_gain = (adv * delta)[live].sum()
    assert surrogate_gain > 0.8 * (adv * delta)[live].abs().sum()  # mostly agreeing, not by a hair
    nonzero = pos | neg
    agree = (torch.sign(delta[nonzero]) == torch.sign(adv[nonzero])).float().mean()
    assert agree > 0.6, agree  # most single transitions too (0.75–0.81 measured)


def test_flow_grpo_advantage_sign_follows_the_hand_made_reward(tmp_path, monkeypatch):
    """Brightness is the reward: inside each group the brighter final images get the positive
    advantage on every trained step (computed here from the decoded images, not from the loop)."""
    s = small_session("flow_grpo", tmp_path / "run")
    seen, _ = record_iteration(s, monkeypatch)
    ro, adv, group = seen["ro"], seen["adv"], seen["group"]
    with torch.no_grad():
        reward = s.model.decode(ro.states[:, -1]).mean(dim=(1, 2, 3))  # (B,)
    torch.testing.assert_close(seen["values"][:, -1], reward)
    centred = reward - torch.stack([reward[group == g].mean() for g in group.tolist()])
    trained_adv = adv[:, s.trained]  # (B, K): one advantage copied to every trained step
    assert (trained_adv == trained_adv[:, :1]).all()
    assert torch.equal(torch.sign(trained_adv[:, 0]), torch.sign(centred))
    assert (adv[:, ~s.trained] == 0).all()


def _velocity_gap(s, ro, cond, group) -> float:
    """Mean squared difference between the policy's and the reference's velocities on the recorded
    states of the trained steps (0 when the policy is the reference)."""
    gaps = []
    with torch.no_grad():
        for i in torch.nonzero(s.trained, as_tuple=True)[0].tolist():
            x, sigma = ro.states[:, i], s.sigmas[i].expand(len(group))
            v = s.model.velocity(x, sigma, cond[group])
            with s.policy.reference():
                v_ref = s.model.velocity(x, sigma, cond[group])
            gaps.append(((v - v_ref) ** 2).mean())
    return torch.stack(gaps).mean().item()


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_the_kl_term_pulls_the_policy_to_the_reference(beta, tmp_path):
    """A policy moved off the reference (LoRA B drawn at random), zero advantages: with β > 0 the
    update shrinks the policy–reference gap; with β = 0 nothing moves (no weight decay here)."""
    s = small_session("flow_grpo", tmp_path / "run", beta=beta, weight_decay=0.0, lr=3e-3)
    perturb_lora(s)
    batch = s.draw(0)
    cond = s.model.encode(batch.prompts).detach()
    plan = iteration_plan(s.cfg, s.sigmas, 0)
    sam = sample(
        s.model,
        cond,
        batch.group,
        batch.x0,
        plan,
        s.levels,
        s.step_fn,
        seeded(0, 0, 2),
        batch.rows,
        **s.rollout_opts,
    )
    ro = sam.ro
    before = _velocity_gap(s, ro, cond, batch.group)
    assert before > 1e-4
    adv = torch.zeros(len(batch.group), s.cfg.num_steps)
    keep = torch.arange(len(batch.group))
    stats = ppo_update(s, plan, s.levels, sam, adv, batch.prompts, keep, seeded(0, 0, 3))
    after = _velocity_gap(s, ro, cond, batch.group)
    if beta:
        assert stats["loss/kl"] > 0 and after < 0.9 * before, (before, after)
    else:
        assert after == pytest.approx(before, rel=1e-6)


def test_ema_averages_the_weights_after_every_optimizer_step(tmp_path):
    """The loop's EMA is ``s ← d·s + (1 − d)·p`` after each optimizer step, recomputed here from the
    weights each step left (d = 0.75)."""
    from flowcredit.train import grpo_iteration

    s = small_session("flow_grpo", tmp_path / "run", ema_decay=0.75)
    shadow = [p.detach().clone() for p in s.params]
    real_step = s.optimizer.step

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        for avg, p in zip(shadow, s.params):
            avg.copy_(0.75 * avg + 0.25 * p.detach())
        return out

    s.optimizer.step = step
    metrics = grpo_iteration(s, 0)
    assert metrics["stats/optimizer_steps"] >= 2
    for got, want in zip(s.ema.shadow, shadow):
        torch.testing.assert_close(got, want)
    assert any(not torch.equal(avg, p) for avg, p in zip(shadow, s.params))
