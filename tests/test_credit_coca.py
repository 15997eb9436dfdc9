"""CoCA's credit (``coca``, docs/algorithms.md §5.5): the shares and the advantages against hand-computed
tensors and against an independent loop that follows the authors' code step by step; the edge cases
(all-equal rewards, all-equal similarities, Σg = 0, untrained steps); the plumbing that hands the rule
``c_i = cos(x̂0_i, x_N)`` (a tiny rollout, a real iteration, the credit audit), checked against a direct
computation from the stored states."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowcredit.advantages import CREDITS, coca, flow_grpo
from flowcredit.contribution import remaining_share, similarity_to_final, window_shares
from flowcredit.run.rollout import rollout, state_values
from flowcredit.schedule import sigmas as make_sigmas
from flowcredit.sde import SAMPLERS

T, F = True, False
ALL4 = torch.tensor([T, T, T, T])
# two rows of one group: similarities c_0 … c_3 (c_4 = 1) and the final reward in the last column
VALUES = torch.tensor([[0.2, 0.5, 0.6, 0.8, 1.0], [0.6, 0.7, 0.9, 0.95, 0.0]])
PAIR = torch.tensor([0, 0])


def with_final(c: list[list[float]]) -> torch.Tensor:
    """``(B, M + 1)`` similarities with ``c_M = 1`` appended."""
    return torch.cat([torch.tensor(c), torch.ones(len(c), 1)], dim=1)


# --- the shares ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "c,window,shares,remaining",
    [
        # one step per window: g_j = c_{j+1} − c_j over Σg = 1 − c_0, s_j = (1 − c_j)/(1 − c_0)
        ([0.2, 0.5, 0.6, 0.8], 1, [0.375, 0.125, 0.25, 0.25], [1.0, 0.625, 0.5, 0.25]),
        ([0.6, 0.7, 0.9, 0.95], 1, [0.25, 0.5, 0.125, 0.125], [1.0, 0.75, 0.25, 0.125]),
        # windows of 2: m_0 = (.5 + .6)/2 = .55, m_1 = (.8 + 1)/2 = .9; g = (.35, .35), Σg = .7
        ([0.2, 0.5, 0.6, 0.8], 2, [0.25, 0.25, 0.25, 0.25], [1.0, 0.75, 0.5, 0.25]),
        # m_0 = .8, m_1 = .975; g = (.2, .175), Σg = .375: .2/.75 and .175/.75 per step
        ([0.6, 0.7, 0.9, 0.95], 2, [4 / 15, 4 / 15, 7 / 30, 7 / 30], [1.0, 11 / 15, 7 / 15, 7 / 30]),
        # a window that does not divide 3 steps: the last holds 1; m = (.55, 1), g = (.35, .45), Σg = .8
        ([0.2, 0.5, 0.6], 2, [0.21875, 0.21875, 0.5625], [1.0, 0.78125, 0.5625]),
        # a step that moved away from the image: a negative share, kept (the code keeps it)
        ([0.5, 0.7, 0.6], 1, [0.4, -0.2, 0.8], [1.0, 0.6, 0.8]),
    ],
)
def test_shares_by_hand(c, window, shares, remaining):
    got = window_shares(with_final([c]), window, eps=0.0)
    torch.testing.assert_close(got, torch.tensor([shares]))
    torch.testing.assert_close(remaining_share(got), torch.tensor([remaining]))
    assert got.sum().item() == pytest.approx(1.0)


def test_degenerate_rows_share_equally():
    """Σg = 0 (all similarities equal, or gains that cancel) and |Σg| ≤ eps: 1/M per step, never inf or
    NaN; the other row of the batch is untouched."""
    c = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 0.2, 0.9, 0.5], [0.2, 0.5, 0.6, 1.0]])
    got = window_shares(c, 1, eps=0.0)
    torch.testing.assert_close(got[:2], torch.full((2, 3), 1 / 3))
    torch.testing.assert_close(got[2], torch.tensor([0.375, 0.125, 0.5]))
    near = torch.tensor([[0.5, 0.9, 0.2, 0.50005]])  # Σg = 5e-5 ≤ eps = 1e-4
    torch.testing.assert_close(window_shares(near, 1, eps=1e-4), torch.full((1, 3), 1 / 3))
    with pytest.raises(ValueError, match="window"):
        window_shares(c, 0, eps=0.0)


def test_similarity_to_final_by_hand():
    clean = torch.tensor([[[1.0, 0.0], [1.0, 1.0], [-2.0, 0.0]]])  # (1, 3, 2)
    final = torch.tensor([[3.0, 0.0]])
    torch.testing.assert_close(similarity_to_final(clean, final), torch.tensor([[1.0, 2**-0.5, -1.0]]))


# --- the advantages ---------------------------------------------------------------------------------


def test_coca_by_hand():
    """Â = ±1 (rewards 1 and 0, group std 0.5, eps 0); temporal rewards Â·s; then the group's z-score
    over its 8 entries (mean 0.25/8 = 0.03125)."""
    shaped = torch.tensor([[1.0, 0.625, 0.5, 0.25], [-1.0, -0.75, -0.25, -0.125]])
    got = coca(VALUES, PAIR, ALL4, eps=0.0, renorm="none")
    torch.testing.assert_close(got, shaped)
    centred = shaped - 0.03125
    std = float(np.sqrt((centred.numpy() ** 2).mean()))
    torch.testing.assert_close(coca(VALUES, PAIR, ALL4, eps=0.0), centred / std)
    # α = 0.5: Â·(0.5 + 0.5·s)
    half = coca(VALUES, PAIR, ALL4, eps=0.0, alpha=0.5, renorm="none")
    torch.testing.assert_close(
        half, torch.tensor([[1.0, 0.8125, 0.75, 0.625], [-1.0, -0.875, -0.625, -0.5625]])
    )


def test_alpha_one_is_flow_grpo():
    """α = 1 drops the shares: without the second z-score, CoCA is Flow-GRPO's advantage (both stds)."""
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(6, 5, generator=gen)
    group, trained = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([T, T, F, T])
    for global_std in (False, True):
        want = flow_grpo(values, group, trained, global_std=global_std)
        got = coca(values, group, trained, alpha=1.0, renorm="none", global_std=global_std)
        torch.testing.assert_close(got, want)


def test_untrained_steps_get_zero_and_enter_no_statistic():
    """Steps 0 and 3 untrained: 0 there; the z-score is over the 4 trained entries only, while the
    shares (span "trajectory") still count every step."""
    trained = torch.tensor([F, T, T, F])
    got = coca(VALUES, PAIR, trained, eps=0.0)
    shaped = torch.tensor([[0.625, 0.5], [-0.75, -0.25]])  # the trained columns of the hand example
    centred = shaped - shaped.mean()
    want = torch.zeros(2, 4)
    want[:, 1:3] = centred / centred.pow(2).mean().sqrt()
    torch.testing.assert_close(got, want)


def test_span_window_shares_over_the_trained_steps_only():
    """``span="window"``, steps 1–2: c_1 … c_3 = (.5, .6, .8) for row 0, gains (.1, .2) of .3: s = (1, 2/3);
    row 1 (.7, .9, .95): gains (.2, .05) of .25: s = (1, .2)."""
    trained = torch.tensor([F, T, T, F])
    got = coca(VALUES, PAIR, trained, eps=0.0, span="window", renorm="none")
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.0, 2 / 3, 0.0], [0.0, -1.0, -0.2, 0.0]]))
    with pytest.raises(ValueError, match="contiguous"):
        coca(VALUES, PAIR, torch.tensor([T, F, T, F]), span="window")


def test_equal_rewards_give_zero_and_equal_similarities_no_nan():
    values = VALUES.clone()
    values[:, -1] = 0.7  # one group, equal rewards: Â = 0 everywhere
    assert torch.equal(coca(values, PAIR, ALL4), torch.zeros(2, 4))
    flat = VALUES.clone()
    flat[:, :-1] = 1.0  # every prediction already the image: Σg = 0, equal shares (1, .75, .5, .25)
    got = coca(flat, PAIR, ALL4, eps=0.0, renorm="none")
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.75, 0.5, 0.25], [-1.0, -0.75, -0.5, -0.25]]))
    assert torch.isfinite(coca(flat, PAIR, ALL4)).all()


def test_batch_renorm_pools_the_groups_and_the_clip_binds():
    values = torch.cat([VALUES, VALUES])
    group = torch.tensor([0, 0, 1, 1])
    per_group = coca(values, group, ALL4, eps=0.0)
    torch.testing.assert_close(coca(values, group, ALL4, eps=0.0, renorm="batch"), per_group)  # same pools
    values[2:, -1] = 0.5  # group 1 ties: Â = 0 there, but the batch mean moves it off 0
    batch = coca(values, group, ALL4, eps=0.0, renorm="batch")
    assert (batch[2:] != 0).all() and torch.equal(coca(values, group, ALL4, eps=0.0)[2:], torch.zeros(2, 4))
    assert coca(VALUES, PAIR, ALL4, adv_clip=0.5).abs().max() == 0.5
    with pytest.raises(ValueError, match="renorm"):
        coca(VALUES, PAIR, ALL4, renorm="prompt")


def independent_coca(values: np.ndarray, group: np.ndarray, trained: np.ndarray, window: int, eps: float):
    """The authors' steps written out with numpy loops (float64): the group z-score of the rewards and
    its clip; per row the similarities with c_N = 1, the window means of c_1 … c_N, the gains, the
    shares, their reversed running sum; the temporal rewards; the group z-score of the trained entries."""
    b, n = values.shape[0], values.shape[1] - 1
    adv = np.zeros(b)
    for g in np.unique(group):
        r = values[group == g, -1]
        adv[group == g] = 0.0 if r.max() == r.min() else (r - r.mean()) / (r.std() + eps)
    adv = np.clip(adv, -5, 5)
    temporal = np.zeros((b, n))
    for row in range(b):
        c = list(values[row, :-1]) + [1.0]
        starts = list(range(0, n, window))
        means = [np.mean(c[s + 1 : min(s + window, n) + 1]) for s in starts]
        gains = [means[0] - c[0]] + [means[k] - means[k - 1] for k in range(1, len(means))]
        weight = np.zeros(n)
        for k, s in enumerate(starts):
            size = min(s + window, n) - s
            weight[s : s + size] = gains[k] / (sum(gains) * size)
        running = 0.0
        for i in reversed(range(n)):
            running += weight[i]
            temporal[row, i] = adv[row] * running
    out = np.zeros((b, n))
    for g in np.unique(group):
        x = temporal[group == g][:, trained]
        z = np.zeros_like(x) if x.max() == x.min() else (x - x.mean()) / (x.std() + eps)
        block = out[group == g]
        block[:, trained] = z
        out[group == g] = block
    return np.clip(out, -5, 5)


@pytest.mark.parametrize(
    "window,trained", [(1, [T] * 6), (2, [T] * 6), (4, [T, T, T, T, T, F]), (3, [F, T] * 3)]
)
def test_coca_equals_an_independent_computation(window, trained):
    gen = torch.Generator().manual_seed(window)
    values = torch.cat([0.3 + 0.6 * torch.rand(8, 6, generator=gen), torch.rand(8, 1, generator=gen)], 1)
    group, mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.tensor(trained)
    got = coca(values, group, mask, window=window)
    want = independent_coca(values.double().numpy(), group.numpy(), mask.numpy(), window, 1e-4)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_the_registry_entry_and_its_options():
    from flowcredit.errors import ConfigError
    from flowcredit.presets import NEWER_PRESETS, PRESETS, load_config
    from flowcredit.validation import credit_options

    entry = CREDITS["coca"]
    assert entry.fn is coca and entry.needs == "similarity" and entry.fields == {"global_std": "global_std"}
    cfg = load_config("coca")
    assert (cfg.credit, cfg.sampler, cfg.noise_level) == ("coca", "flow_sde", 0.7)
    assert credit_options(cfg) == {
        "window": 1,
        "alpha": 0.0,
        "span": "trajectory",
        "renorm": "group",
        "global_std": False,
    }
    names = list(PRESETS)  # registered after flow_dppo (tests/test_resume.py pairs presets by position)
    assert names.index("coca") == names.index("flow_dppo") + 1 and "coca" in NEWER_PRESETS
    assert credit_options(load_config("coca", None, ["--credit_options", '{"window": 5}']))["window"] == 5
    with pytest.raises(ConfigError, match="window"):
        load_config("coca", None, ["--credit_options", '{"window": "5"}'])


def test_the_skill_arm_is_the_preset_with_coca_credit_at_its_network_calls():
    """The pre-registered arm (docs/benchmarks.md, "CoCA's claim") changes the credit only and runs the
    preset's 450 iterations: its values cost no network call."""
    from flowcredit.commands.bench_skill import SKILL_ARMS, SKILL_CLAIMS, nominal_calls
    from flowcredit.presets import load_config

    base = load_config("skill")
    arm = load_config("skill", None, SKILL_ARMS["coca"](base))
    assert {k: v for k, v in vars(arm).items() if getattr(base, k) != v} == {"credit": "coca"}
    assert nominal_calls(arm) == nominal_calls(base) and arm.iterations == 450
    assert (
        "skill-coca",
        "CoCA: at least as good as Flow-GRPO at equal network calls",
        "noninferior",
    ) in SKILL_CLAIMS


# --- the plumbing -------------------------------------------------------------------------------------


class Affine:
    """A fake adapter whose velocity is not a multiple of x (x̂0 then is not either): v = x/2 + cond."""

    latent_shape = (1, 2, 2)

    def velocity(self, x, sigma, cond):
        return 0.5 * x + cond.view(-1, 1, 1, 1)

    def decode(self, x):
        return x


def direct_similarities(model, ro, sigmas, cond, group) -> torch.Tensor:
    """``(B, N)``: per row and state, v from the model, x̂0 = x − σ·v, cos = ⟨x̂0, x_N⟩ / (|x̂0|·|x_N|)."""
    b, n = ro.logp.shape
    out = torch.zeros(b, n)
    for r in range(b):
        final = ro.states[r, n].flatten()
        for i in range(n):
            x = ro.states[r, i]
            v = model.velocity(x[None], sigmas[i : i + 1], cond[group[r : r + 1]])[0]
            clean = (x - sigmas[i] * v).flatten()
            out[r, i] = clean @ final / (clean.norm() * final.norm())
    return out


def test_state_values_deliver_the_similarities_of_the_stored_states():
    n, group = 5, torch.tensor([0, 0, 1])
    sigmas, levels = make_sigmas(n), torch.tensor([0.7, 0.7, 0.7, 0.7, 0.0])
    x0 = torch.randn(3, 1, 2, 2, generator=torch.Generator().manual_seed(0))
    model, cond = Affine(), torch.tensor([[0.3], [-0.8]])
    args = (model, cond, group, x0, sigmas, levels, SAMPLERS["flow_sde"])
    kept = rollout(*args, torch.Generator().manual_seed(1), keep_velocity=True)
    plain = rollout(*args, torch.Generator().manual_seed(1))
    trained = levels > 0

    def score(images, rows):
        return images.flatten(1).sum(dim=1)

    reused, nfe_reused = state_values(
        model, cond, group, kept, sigmas, "similarity", trained, "euler", 1, score
    )
    called, nfe_called = state_values(
        model, cond, group, plain, sigmas, "similarity", trained, "euler", 1, score
    )
    assert nfe_reused == 0 and nfe_called == 3 * n
    want = direct_similarities(model, kept, sigmas, cond, group)
    torch.testing.assert_close(reused[:, :n], want)
    torch.testing.assert_close(called, reused)
    torch.testing.assert_close(reused[:, n], kept.states[:, n].flatten(1).sum(dim=1))  # V_N: the reward
    wrong = direct_similarities(model, kept, sigmas, cond, 1 - group)  # another row's prompt: far off
    assert (wrong - want).abs().max() > 1e-2


def test_an_iteration_hands_coca_the_similarities_at_flow_grpo_cost(tmp_path, monkeypatch, one_thread):
    """A real iteration of the preset: its rollout keeps the velocities, its values cost no model call,
    and ``c_i`` equals the test's own computation from the stored states (each row's prompt encoded
    alone, the policy the rollout sampled with)."""
    from loop_probes import perturb_lora, record_iteration, small_session

    s = small_session("coca", tmp_path / "run")
    batch = s.draw(0)
    perturb_lora(s)
    seen, metrics = record_iteration(s, monkeypatch)
    assert metrics["nfe/values"] == 0 and seen["ro"].velocities is not None and metrics["adv/abs_mean"] > 0
    s.policy.load_trainable_state(seen["policy_before_update"])
    ro, n = seen["ro"], s.cfg.num_steps
    want = torch.zeros(ro.states.shape[0], n)
    with torch.no_grad():
        for r, g in enumerate(batch.group.tolist()):
            cond = s.model.encode([batch.prompts[g]])
            for i in range(n):
                x = ro.states[r, i]
                v = s.model.velocity(x[None], s.sigmas[i : i + 1], cond)[0].float()
                want[r, i] = similarity_to_final((x - s.sigmas[i] * v)[None, None], ro.states[r, n][None])[
                    0, 0
                ]
    torch.testing.assert_close(seen["values"][:, :n], want, atol=2e-5, rtol=1e-4)
    assert torch.isfinite(seen["values"]).all()


def test_the_credit_audit_scores_coca(tmp_path):
    """The audit runs CoCA on its own trajectories with no value call: its credit is the rule applied to
    the similarities of the audit's rollout."""
    from loop_probes import small_config, small_model

    from flowcredit.models import load_model
    from flowcredit.run.audit import AUDIT_RULES, audit_group, audit_rules
    from flowcredit.run.session import build_reward
    from flowcredit.tasks.shapes import load_prompts

    assert AUDIT_RULES["coca"] == ["--credit", "coca"] and "coca" in audit_rules()
    cfg = small_config("flow_grpo", tmp_path / "r", checkpoint=small_model(tmp_path / "m"), group_size=4)
    model, reward = load_model(cfg), build_reward(cfg, cfg.reward)
    a = audit_group(model, cfg, reward, load_prompts("test")[:1], audit_rules("flow_grpo,coca"), 2)
    assert a.nfe["coca"] == 0 and a.credit["coca"].shape == (4, cfg.num_steps)
    assert torch.isfinite(a.credit["coca"]).all() and (a.credit["coca"][:, ~a.trained] == 0).all()
