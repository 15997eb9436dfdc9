"""Tree rollouts (flowcredit/tree_plans.py, flowcredit/run/plans.py ``tree_sample``): the edge values by
hand and against an independent recursion, the edges each leaf trains, the network calls, TreeGRPO's
window draws, the rollout's shared prefixes on the built-in model, and a toy tree plan registered from
outside the package that trains."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from loop_probes import small_config

from flowcredit.errors import ConfigError
from flowcredit.step_plan import TreeShape
from flowcredit.step_schedules import STEP_SCHEDULES, make_plan, register_step_schedule
from flowcredit.tree_plans import owned_steps, tree_advantages, tree_calls, tree_plan, treegrpo


def test_edge_values_by_hand():
    leaf = torch.tensor([1.0, -1.0, 3.0, 0.0])  # one tree, k = 2, d = 2
    logp = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [0.0, 0.0], [0.0, 0.0]])  # (B, d)
    # node 0's children weigh softmax([0, log 3]) = [1/4, 3/4]: 1/4 − 3/4 = −0.5; node 1: (3 + 0)/2
    want = torch.tensor([[-0.5, 1.0], [-0.5, -1.0], [1.5, 3.0], [1.5, 0.0]])
    assert torch.allclose(tree_advantages(leaf, logp, 2), want)
    uniform = torch.tensor([[0.0, 1.0], [0.0, -1.0], [1.5, 3.0], [1.5, 0.0]])
    assert torch.allclose(tree_advantages(leaf, logp, 2, "uniform"), uniform)


def recursive_values(leaf: list[float], logp: list[list[float]], k: int, d: int) -> list[list[float]]:
    """An independent computation: the tree as nested nodes, values by recursion, read back per leaf."""

    def value(depth: int, first: int) -> float:  # the node of ``depth`` whose first leaf is ``first``
        if depth == d:
            return leaf[first]
        span = k ** (d - depth - 1)  # leaves under each child
        kids = [first + c * span for c in range(k)]
        w = torch.softmax(torch.tensor([logp[c][depth] for c in kids]), 0).tolist()
        return sum(wi * value(depth + 1, c) for wi, c in zip(w, kids))

    per = k**d
    out = []
    for r in range(len(leaf)):
        base = r - r % per
        row = []
        for j in range(d):  # the edge at depth j leads to the node of depth j + 1 above leaf r
            span = k ** (d - j - 1)
            row.append(value(j + 1, base + (r - base) // span * span))
        out.append(row)
    return out


@pytest.mark.parametrize("k, d", [(3, 3), (2, 4), (4, 1)])
def test_edge_values_against_a_recursion(k, d):
    g = torch.Generator().manual_seed(k * 10 + d)
    b = 2 * k**d  # two trees
    leaf = torch.randn(b, generator=g)
    logp = torch.randn(b, d, generator=g)
    # an edge's log-density is the same on every leaf below it: copy the first leaf's
    for j in range(d):
        span = k ** (d - 1 - j)
        logp[:, j] = logp[torch.arange(b) // span * span, j]
    got = tree_advantages(leaf, logp, k)
    want = torch.tensor(recursive_values(leaf.tolist(), logp.tolist(), k, d))
    assert torch.allclose(got, want, atol=1e-6)


def test_each_edge_is_trained_once():
    sde = torch.tensor([True, True, False])  # splits at steps 0 and 1, the ODE at step 2
    owned = owned_steps(8, TreeShape(2, (0, 1)), sde)  # two trees of 4 leaves
    assert (
        owned.tolist()
        == [[True, True, False], [False, True, False], [True, True, False], [False, True, False]] * 2
    )
    assert int(owned_steps(27, TreeShape(3, (0, 1, 2)), torch.ones(3, dtype=torch.bool)).sum()) == 3 + 9 + 27


def test_network_calls_of_a_tree():
    sigmas = torch.linspace(1, 0, 11)
    plan = tree_plan(sigmas, [2, 3, 4], 3)  # trunk 2 steps; 3 × 1, 9 × 1, 27 × 6 after
    calls_per_tree = 2 + 3 * 1 + 9 * 1 + 27 * 6
    assert tree_calls(plan, 27) == pytest.approx(calls_per_tree / 27)
    assert calls_per_tree < 27 * 10  # what 27 independent trajectories would cost


def test_treegrpo_window_draws():
    sigmas = torch.linspace(1, 0, 11)  # 10 steps, depth 3, skip_last 1: starts 0 … 6
    counts = torch.zeros(7)
    g = torch.Generator().manual_seed(0)
    for it in range(6000):
        plan = treegrpo(sigmas, level=0.7, iteration=it, total=10, generator=g, p=0.4)
        steps = plan.sde.nonzero()[:, 0].tolist()
        assert steps == list(range(steps[0], steps[0] + 3)) and plan.tree.fanout == 3
        counts[steps[0]] += 1
    want = 0.4 * 0.6 ** torch.arange(7.0)
    assert torch.allclose(counts / counts.sum(), want / want.sum(), atol=0.02)

    def drawn(seed):  # the registry's entry, drawn from a given generator
        gen = torch.Generator().manual_seed(seed)
        return make_plan("treegrpo", sigmas, level=0.7, iteration=0, total=1, generator=gen).sde

    assert torch.equal(drawn(5), drawn(5))


def toy_tree(sigmas, *, level, iteration, total, generator, at=(1, 3)):
    """A tree plan from outside the package: branch in two at the steps ``at``."""
    return tree_plan(sigmas, list(at), 2)


def test_a_toy_tree_plan_from_outside_trains(tmp_path, monkeypatch):
    from loop_probes import record_iteration, small_session

    if "toy_tree" not in STEP_SCHEDULES:
        register_step_schedule("toy_tree", toy_tree)
    s = small_session(
        "flow_grpo", tmp_path, step_schedule="toy_tree", shared_noise=True, group_size=4, num_steps=5
    )
    seen, metrics = record_iteration(s, monkeypatch)
    ro, adv = seen["ro"], seen["adv"]  # (8, 6, …) states of 2 trees × 4 leaves
    states = ro.states
    for tree in (0, 4):
        leaves = states[tree : tree + 4]
        assert all(torch.equal(leaves[i, :2], leaves[0, :2]) for i in range(4))  # the trunk: x_0, x_1
        assert torch.equal(leaves[0, :4], leaves[1, :4]) and not torch.equal(leaves[0, 2], leaves[2, 2])
        assert not torch.equal(leaves[0, 4], leaves[1, 4])  # the second branching at step 3
    trained = seen["sampled"].row_trained
    assert trained[:, [1, 3]].tolist() == [[True, True], [False, True], [True, True], [False, True]] * 2
    assert not trained[:, [0, 2, 4]].any() and bool((adv[~trained] == 0).all())
    # two trees: trunk 1 step, 2 nodes × 2 steps, 4 leaves × 2 steps, per tree
    assert metrics["nfe/rollout"] == s.guidance_passes * 2 * (1 + 2 * 2 + 4 * 2)


def test_a_tree_needs_its_group_and_a_shared_noise(tmp_path):
    from flowcredit.run.plans import iteration_plan

    cfg = small_config("tree_grpo", tmp_path)  # 27 leaves: the preset's group
    sigmas = torch.linspace(1, 0, cfg.num_steps + 1)
    with pytest.raises(ConfigError, match="group_size.*27 leaves"):
        iteration_plan(dataclasses.replace(cfg, group_size=6), sigmas, 0)
    with pytest.raises(ConfigError, match="shared_noise"):
        iteration_plan(dataclasses.replace(cfg, shared_noise=False), sigmas, 0)


def test_the_skill_arm_spends_the_presets_calls_and_its_claim_is_registered():
    from flowcredit.commands.bench_skill import SKILL_ARMS, nfe_parts, nominal_calls, trained_per_row
    from flowcredit.commands.bench_skill_report import SKILL_CLAIMS
    from flowcredit.presets import load_config
    from flowcredit.validation import apply_overrides

    base = load_config("skill")
    arm = apply_overrides(load_config("skill"), SKILL_ARMS["tree"](load_config("skill")))
    changed = {k: v for k, v in vars(arm).items() if getattr(base, k) != v}
    assert changed == {
        "step_schedule": "treegrpo",
        "step_schedule_options": '{"skip_last": 5}',
        "group_size": 27,
        "shared_noise": True,
        "iterations": 373,
    }
    plan = tree_plan(torch.linspace(1, 0, 11), [0, 1, 2], 3)
    assert trained_per_row(plan) == pytest.approx((3 + 9 + 27) / 27)
    assert nfe_parts(arm)["update"] == pytest.approx(2 * 39 / 27)  # β > 0: the reference pass too

    def spent(c):  # network calls of the whole run, every row counted
        return c.iterations * nominal_calls(c) * c.prompts_per_iter * c.group_size

    assert spent(arm) == pytest.approx(spent(base), rel=0.002)  # equal calls, up to an iteration's rounding
    claim = ("skill-tree", "TreeGRPO: at least as good as Flow-GRPO at equal network calls", "noninferior")
    assert claim in SKILL_CLAIMS


# --- BranchGRPO: SDE paths between the splits, node values z-scored per depth ---


def test_depth_zscore_by_hand():
    from flowcredit.tree_plans import depth_zscore, node_values

    leaf = torch.tensor([1.0, 3.0, 2.0, 2.0])  # one tree, k = 2, d = 2; uniform weights: means
    values = node_values(leaf, torch.zeros(4, 2), 2, "uniform")
    assert values.tolist() == [[2.0, 2.0, 1.0], [2.0, 2.0, 3.0], [2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    z = depth_zscore(values, 2, eps=0.0)
    # root alone: 0; depth 1: both nodes 2.0: 0; leaves 1, 3, 2, 2: mean 2, population std √0.5
    s = math.sqrt(0.5)
    assert torch.allclose(z, torch.tensor([[0, 0, -1 / s], [0, 0, 1 / s], [0, 0, 0], [0, 0, 0.0]]))


def test_transitions_between_splits_take_their_nodes_value():
    from flowcredit.tree_plans import edge_advantages

    shape = TreeShape(2, (0, 2), "uniform")  # splits at 0 and 2; step 1 a path of its own, step 3 ODE
    sde = torch.tensor([True, True, True, False])
    leaf = torch.tensor([1.0, -1.0, 4.0, 0.0])
    adv = edge_advantages(leaf, torch.zeros(4, 4), shape, sde)
    depth1 = [0.0, 0.0, 2.0, 2.0]  # the means of leaves (1, −1) and (4, 0)
    assert adv[:, 0].tolist() == depth1 and adv[:, 1].tolist() == depth1  # step 1 leads into depth 1
    assert adv[:, 2].tolist() == leaf.tolist() and adv[:, 3].tolist() == [0.0] * 4
    owned = owned_steps(4, shape, sde)
    assert owned[:, 1].tolist() == [True, False, True, False] and not owned[:, 3].any()
    plan = tree_plan(torch.linspace(1, 0, 5), [0, 2], 2, sde_steps=[1])
    assert tree_calls(plan, 4) == pytest.approx((0 + 2 * 2 + 4 * 2) / 4)


def test_branchgrpo_iteration_shares_each_nodes_path(tmp_path, monkeypatch):
    from loop_probes import record_iteration, small_session

    options = '{"splits": [0, 2]}'  # 5 steps: SDE on 0–3, splits at 0 and 2: 4 leaves
    s = small_session(
        "branch_grpo", tmp_path, group_size=4, num_steps=5, step_schedule_options=options, shared_noise=True
    )
    seen, metrics = record_iteration(s, monkeypatch)
    states, trained = seen["ro"].states, seen["sampled"].row_trained  # (8, 6, …), (8, 5)
    for t in (0, 4):
        assert torch.equal(states[t, :3], states[t + 1, :3])  # leaves 0, 1 share their depth-1 node's path
        assert not torch.equal(states[t, 3], states[t + 1, 3])  # and split at step 2
        assert not torch.equal(states[t, 1], states[t + 2, 1])  # the two depth-1 nodes differ from step 0
    yes, no = True, False
    owned = [[yes, yes, yes, yes, no], [no, no, yes, yes, no]] * 2  # depth-1 transitions: leaves 0, 2
    assert trained[:4].tolist() == owned
    assert metrics["nfe/rollout"] == s.guidance_passes * 2 * (2 * 2 + 4 * 3)  # 2 trees: 2 nodes × 2, 4 × 3


def test_scaled_noise_draws_wider_and_scores_under_the_steps_own_density():
    """BranchGRPO's split noise: ``x' = mean + std·(4ε)``, its log-density under ``N(mean, std²)`` (a
    ``torch.distributions`` Normal, mean over dimensions); a given ``x_next`` is re-scored as the step
    does; scale 1 is the step itself."""
    from flowcredit.sde import SAMPLERS, scaled_noise

    step = SAMPLERS["flow_sde"]
    v, x, eps = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    plain = step(v, x, 0.8, 0.6, 0.3, noise=eps)
    wide = scaled_noise(step, 4.0)(v, x, 0.8, 0.6, 0.3, noise=eps)
    std = plain.std.view(2, 1, 1, 1)
    assert torch.allclose(wide.x_next, plain.mean + 4.0 * std * eps, atol=1e-6)
    density = torch.distributions.Normal(plain.mean, std.expand_as(plain.mean))
    assert torch.allclose(wide.logp, density.log_prob(wide.x_next).mean(dim=(1, 2, 3)), atol=1e-5)
    again = scaled_noise(step, 4.0)(v, x, 0.8, 0.6, 0.3, x_next=wide.x_next)
    assert torch.equal(again.logp, step(v, x, 0.8, 0.6, 0.3, x_next=wide.x_next).logp)
    assert scaled_noise(step, 1.0) is step


class _HalfVelocity:
    """A stand-in network with ``v = x / 2``: the sampler's mean at any state is known."""

    def velocity(self, x, sigma, cond):
        return 0.5 * x


@pytest.mark.parametrize("split_noise", [1.0, 4.0])
def test_a_tree_widens_its_splits_only(split_noise):
    """A BranchGRPO tree (splits 0 and 2 of 5 SDE steps): at a split the draw's noise ``(x' − mean)/std``
    has RMS ≈ ``split_noise`` and its stored log-density is the step's own; between splits RMS ≈ 1. At
    ``split_noise`` 1 the rollout is the one of a single segment per split (the draws are the same)."""
    from flowcredit.run.plans import tree_sample
    from flowcredit.sde import SAMPLERS
    from flowcredit.tree_plans import branchgrpo

    sig = torch.linspace(1, 0, 6)
    opts = dict(level=0.3, iteration=0, total=1, generator=None, splits=[0, 2], skip_last=1)
    plan = branchgrpo(sig, **opts, split_noise=split_noise)
    step, levels = SAMPLERS["flow_sde"], torch.full((5,), 0.3)
    levels[4] = 0.0
    x0 = torch.randn(1, 3, 16, 16).repeat(4, 1, 1, 1)
    group, cond = torch.zeros(4, dtype=torch.long), torch.zeros(1)
    gen = torch.Generator().manual_seed(0)
    out = tree_sample(_HalfVelocity(), cond, group, x0, plan, levels, step, gen, (4, 0, 4))
    states, logp = out.ro.states, out.ro.logp  # (4, 6, …), (4, 5)
    for i in range(4):  # the SDE steps
        x, x_next = states[:, i], states[:, i + 1]
        again = step(0.5 * x, x, sig[i].item(), sig[i + 1].item(), 0.3, x_next=x_next)
        rms = ((x_next - again.mean) / again.std.view(-1, 1, 1, 1)).pow(2).mean().sqrt().item()
        want = split_noise if i in (0, 2) else 1.0
        assert rms == pytest.approx(want, rel=0.1), (i, rms)
        assert torch.allclose(logp[:, i], again.logp, atol=1e-5)
