"""Rollout plumbing: which states get values (copy, anchoring), batches, the sign-keeping Stepwise
normalisation; hand-computed expectations."""

from __future__ import annotations

import math

import pytest
import torch

from flowcredit.advantages import ADVANTAGES, CREDITS
from flowcredit.run.rollout import draw_batch, needed_states, plan_completions, rollout, state_values
from flowcredit.schedule import sigmas as make_sigmas
from flowcredit.sde import SAMPLERS

T, F = True, False


def b(*xs):
    return torch.tensor(xs, dtype=torch.bool)


@pytest.mark.parametrize(
    "deterministic,estimator,compute,copy",
    [
        # window on steps 1–2 of 4, the last step deterministic (cps / ddim_sde): V_3 = V_4 either way
        (b(T, F, F, T), "ode_remaining", b(F, T, T, F, F), b(F, F, F, T, F)),
        (b(T, F, F, T), "euler", b(F, T, T, F, F), b(F, F, F, T, F)),
        # an ODE step inside: only an estimator that follows the schedule may copy V_2 = V_3
        (b(F, F, T, F), "ode_remaining", b(F, T, F, T, F), b(F, F, T, F, F)),
        (b(F, F, T, F), "euler", b(F, T, T, T, F), b(F, F, F, F, F)),
    ],
)
def test_plan_completions_copies_and_anchors(deterministic, estimator, compute, copy):
    need = b(F, T, T, T, T)  # the ends of trained steps 1–3 and V_N
    got_compute, got_copy = plan_completions(need, deterministic, estimator)
    assert torch.equal(got_compute, compute) and torch.equal(got_copy, copy)


def test_anchoring_chains_to_the_final_state():
    # window 0–1 of 5 (flow_sde with ODE steps 2–4 after it): V_2 = V_3 = V_4 = V_5 for euler too
    compute, copy = plan_completions(b(T, T, T, F, F, T), b(F, F, T, T, T), "euler")
    assert torch.equal(compute, b(T, T, F, F, F, F)) and torch.equal(copy, b(F, F, T, T, T, F))


def test_needed_states_follow_the_credit_entry():
    trained = b(F, T, T, F)
    assert torch.equal(needed_states(CREDITS["flow_grpo"].needs, trained), b(F, F, F, F, T))
    assert torch.equal(needed_states(CREDITS["turning_point"].needs, trained), b(F, T, T, T, T))


class Linear:
    """A fake adapter: v = x (so ``x_σ`` shrinks towards 0), decode = identity."""

    latent_shape = (1, 2, 2)

    def velocity(self, x, sigma, cond):
        return x * 0.5

    def decode(self, x):
        return x


def test_euler_values_in_closed_form_and_anchored_window():
    n, group = 5, torch.tensor([0, 0, 1])
    sigmas = make_sigmas(n)
    levels = torch.tensor([0.0, 0.7, 0.7, 0.7, 0.0])  # ddim_sde window 1–3, the rest deterministic
    x0 = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    model, cond = Linear(), torch.zeros(2, 1)
    ro = rollout(
        model, cond, group, x0, sigmas, levels, SAMPLERS["ddim_sde"], torch.Generator().manual_seed(1)
    )
    trained = levels > 0

    def score(images, rows):
        return images.flatten(1).sum(dim=1)

    values, _ = state_values(model, cond, group, ro, sigmas, "states", trained, "euler", 3, score)
    assert torch.equal(values[:, 4], values[:, 5])  # anchored: its remaining step is deterministic
    torch.testing.assert_close(values[:, 5], ro.states[:, 5].flatten(1).sum(dim=1))  # the sampled image
    # euler(3) with v = x/2: three steps of dt = −σ_i/3 scale x_i by (1 − σ_i/6)³ (closed form)
    for i in (1, 2, 3):
        factor = (1 - sigmas[i].item() / 6) ** 3
        torch.testing.assert_close(values[:, i], ro.states[:, i].flatten(1).sum(dim=1) * factor)
    assert torch.isnan(values[:, 0]).all()  # not needed: the first step is outside the window


def test_stepwise_without_centring_keeps_signs_and_zeros():
    # one group of 2 members, 3 trained steps; gains: [0, 0, 0.3] and [0, 0, 0]
    values = torch.tensor([[0.0, 0.0, 0.0, 0.3], [0.5, 0.5, 0.5, 0.5]])
    group, trained = torch.tensor([0, 0]), b(T, T, T)
    adv = ADVANTAGES["stepwise"](values, group, trained, eps=0.0, adv_clip=100.0, center=False)
    rms = math.sqrt(0.3**2 / 6)  # over all 6 (member, step) entries
    want = torch.tensor([[0.0, 0.0, 0.3 / rms], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, want)
    centred = ADVANTAGES["stepwise"](values, group, trained, eps=0.0, adv_clip=100.0)
    assert (centred[1] < 0).all() and (centred[0, :2] < 0).all()  # centring pushes the zero gains down
    clipped = ADVANTAGES["stepwise"](values, group, trained, eps=0.0, adv_clip=2.0, center=False)
    assert clipped[0, 2] == 2.0 and (clipped[0, :2] == 0).all()


def test_draw_batch_is_the_same_rows_on_every_rank():
    metas = [{"prompt": f"p{i}"} for i in range(10)]
    whole = draw_batch(metas, 4, 3, (1, 2, 2), False, seed=5, iteration=2)
    parts = [draw_batch(metas, 4, 3, (1, 2, 2), False, 5, 2, world=2, rank=r) for r in (0, 1)]
    assert [m["prompt"] for p in parts for m in p.metas] == whole.prompts
    assert torch.equal(torch.cat([p.x0 for p in parts]), whole.x0)
    assert torch.equal(parts[1].group, torch.tensor([0, 0, 0, 1, 1, 1]))
    shared = draw_batch(metas, 4, 3, (1, 2, 2), True, seed=5, iteration=2)
    assert torch.equal(shared.x0[0], shared.x0[2]) and not torch.equal(shared.x0[0], shared.x0[3])


def test_category_weights_balance_the_categories():
    from flowcredit.tasks.prompt_sets import PROMPT_WEIGHTS

    metas = [{"prompt": "a", "category": "x"}] * 3 + [{"prompt": "b", "category": "y"}, {"prompt": "c"}]
    assert PROMPT_WEIGHTS["category"](metas) == [1 / 3, 1 / 3, 1 / 3, 1.0, 1.0]
    assert PROMPT_WEIGHTS["uniform"](metas) is None
    # the weighted draw follows the weights: category x (3 prompts) as often as category y (1 prompt)
    metas = [{"prompt": f"x{i}", "category": "x"} for i in range(9)] + [{"prompt": "y", "category": "y"}]
    batch = draw_batch(metas, 4000, 2, (1, 1, 1), False, 0, 0, weights=PROMPT_WEIGHTS["category"](metas))
    share_y = sum(m["category"] == "y" for m in batch.metas) / 4000
    assert abs(share_y - 0.5) < 0.03  # binomial sd 0.008; uniform draws would give 0.1
    again = draw_batch(metas, 4000, 2, (1, 1, 1), False, 0, 0, weights=PROMPT_WEIGHTS["category"](metas))
    assert again.prompts == batch.prompts  # seeded: a resumed run draws the same prompts


def test_rollout_rows_draw_the_noise_of_the_whole_batch():
    n, sigmas, model, cond = 4, make_sigmas(4), Linear(), torch.zeros(2, 1)
    levels = torch.full((n,), 0.7)
    x0 = torch.randn(6, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    step = SAMPLERS["flow_sde"]
    whole = rollout(model, cond, group, x0, sigmas, levels, step, torch.Generator().manual_seed(9))
    halves = [
        rollout(
            model,
            cond,
            group[lo:hi],
            x0[lo:hi],
            sigmas,
            levels,
            step,
            torch.Generator().manual_seed(9),
            rows=(6, lo, hi),
        )
        for lo, hi in ((0, 3), (3, 6))
    ]
    assert torch.equal(torch.cat([h.states for h in halves]), whole.states)  # the 2-rank split = 1 rank
    assert torch.equal(torch.cat([h.logp for h in halves]), whole.logp)
    with pytest.raises(ValueError, match="do not match"):
        rollout(model, cond, group, x0, sigmas, levels, step, torch.Generator(), rows=(6, 0, 3))


def test_one_step_values_reuse_the_rollout_velocity():
    """euler(1) values from the rollout's own velocities: x̂0 = x − σ·v in closed form, no model call,
    equal to the completion that calls the model."""
    n, group = 5, torch.tensor([0, 0, 1])
    sigmas = make_sigmas(n)
    levels = torch.tensor([0.0, 0.7, 0.7, 0.7, 0.0])
    x0 = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    model, cond = Linear(), torch.zeros(2, 1)
    args = (model, cond, group, x0, sigmas, levels, SAMPLERS["ddim_sde"])
    kept = rollout(*args, torch.Generator().manual_seed(1), keep_velocity=True)
    plain = rollout(*args, torch.Generator().manual_seed(1))
    assert plain.velocities is None and torch.equal(kept.states, plain.states)
    torch.testing.assert_close(kept.velocities, kept.states[:, :n] / 2)  # Linear: v = x / 2
    trained = levels > 0

    def score(images, rows):
        return images.flatten(1).sum(dim=1)

    reused, nfe_reused = state_values(model, cond, group, kept, sigmas, "states", trained, "euler", 1, score)
    called, nfe_called = state_values(model, cond, group, plain, sigmas, "states", trained, "euler", 1, score)
    assert nfe_reused == 0 and nfe_called > 0
    torch.testing.assert_close(reused, called, equal_nan=True)
    for i in (1, 2, 3):  # x̂0 = x − σ·x/2
        torch.testing.assert_close(
            reused[:, i], kept.states[:, i].flatten(1).sum(dim=1) * (1 - sigmas[i] / 2)
        )
    # euler(2) does not reuse them: it needs the velocity at an intermediate σ
    _, nfe_two = state_values(model, cond, group, kept, sigmas, "states", trained, "euler", 2, score)
    assert nfe_two > 0


def test_an_iteration_with_one_step_values_calls_no_model_for_them(tmp_path, one_thread):
    from loop_probes import small_session

    from flowcredit.train import grpo_iteration

    s = small_session("dense_grpo", tmp_path, estimator="euler", substeps=1, calibrate=False)
    assert s.rollout_opts["keep_velocity"]
    m = grpo_iteration(s, 0)
    assert m["nfe/values"] == 0 and m["stats/first_ratio_maxdev"] == 0.0
