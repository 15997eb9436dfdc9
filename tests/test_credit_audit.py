"""The credit audit (issue 55): its statistics by hand, its Monte-Carlo values against a closed form,
and that it leaves the model and every generator it does not own untouched."""

from __future__ import annotations

import math

import pytest
import torch

from flowcredit.advantages import CREDITS
from flowcredit.credit_audit import (
    average_ranks,
    group_step_sign_agreement,
    group_step_spearman,
    mc_delta,
    spearman,
    spearman_brown,
    split_halves,
)
from flowcredit.run.audit import mc_completions, mc_needed
from flowcredit.sde import SAMPLERS

ALL = torch.tensor([True])


def test_ranks_and_spearman_by_hand():
    assert average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [2.5, 0.0, 2.5, 1.0]
    # ranks equal but for one swap: 1 − 6·Σd²/(n(n² − 1)) = 1 − 6·2/60
    rho = spearman(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([10.0, 30.0, 20.0, 40.0]))
    assert rho.item() == pytest.approx(0.8)
    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, 1.0])).item() == pytest.approx(-1)
    assert math.isnan(spearman(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([1.0, 2.0, 3.0])).item())


def test_group_step_statistics():
    """Two groups of 3, two steps of which one trained: credit = Δ scores 1, a constant credit 0, and
    sign agreement counts the members where both are non-zero."""
    delta = torch.tensor([[0.3, 9.0], [-0.1, 9.0], [0.0, 9.0], [0.2, 9.0], [0.5, 9.0], [-0.4, 9.0]])
    group, trained = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([True, False])
    assert group_step_spearman(delta, delta, group, trained).tolist() == [[1.0], [1.0]]
    constant = torch.full_like(delta, 0.7)
    assert group_step_spearman(constant, delta, group, trained).tolist() == [[0.0], [0.0]]
    assert group_step_spearman(constant, delta, group, trained, constant_credit_is_zero=False).isnan().all()
    credit = torch.tensor([[1.0], [1.0], [1.0], [-1.0], [1.0], [0.0]]).expand(6, 2)
    # group 0: members 0, 1 counted (Δ = 0 not), agree 1 of 2; group 1: members 3, 4 counted, agree 1 of 2
    assert group_step_sign_agreement(credit, delta, group, trained).tolist() == [[0.5], [0.5]]
    assert spearman_brown(torch.tensor(0.5)).item() == pytest.approx(2 / 3)


def test_flow_grpo_credit_is_delta_on_one_step_trajectories():
    """One step, the group's members sharing x_0 (so V(x_0) is the group's own constant): Flow-GRPO's
    z-scored terminal reward orders the members exactly as Δ_0 = R − V(x_0)."""
    rewards = torch.tensor([0.2, 0.9, 0.5, 0.1, 0.4, 0.3])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    v0 = torch.tensor([0.5, 0.5, 0.5, 0.35, 0.35, 0.35])
    values = torch.stack([v0, rewards], dim=1)  # (B, N + 1) with N = 1
    credit = CREDITS["flow_grpo"].fn(values, group, ALL)
    delta = values[:, 1:] - values[:, :-1]
    assert group_step_spearman(credit, delta, group, ALL).tolist() == [[1.0], [1.0]]
    # but not its sign: group 1's mean reward (0.267) is below V(x_0) = 0.35, so the member with
    # R = 0.3 gets credit +0.4σ for Δ = −0.05 (group 0: Δ = 0 of R = 0.5 is not counted)
    assert group_step_sign_agreement(credit, delta, group, ALL).tolist() == [[1.0], [2 / 3]]


class LinearFlow:
    """A one-dimensional flow with the affine velocity ``v = κx + c``: under DanceGRPO's SDE every
    step's mean is affine in ``x``, so with the reward ``R(x) = x`` the value ``V(x_i) = E[x_N | x_i]``
    has the closed form :func:`closed_form_values`."""

    latent_shape = (1,)

    def __init__(self, kappa: float, c: float):
        self.kappa, self.c = kappa, c

    def velocity(self, x, sigma, cond):
        return self.kappa * x + self.c

    def decode(self, x):
        return x

    def encode(self, prompts):
        return torch.zeros(len(prompts), 1)


def closed_form_values(kappa, c, sig, levels):
    """``(α_i, β_i)`` with ``V(x_i) = α_i·x_i + β_i``: step i's mean is
    ``x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]`` with ``v = κx + c``, ``g = level``, ``dt = σ' − σ``
    (DanceGRPO's SDE), so ``A_i = 1 + dt·[κ + g²/(2σ)·(1 + (1 − σ)κ)]``,
    ``b_i = dt·c·[1 + g²(1 − σ)/(2σ)]``; backwards from ``V(x_N) = x_N``."""
    alpha, beta = [1.0], [0.0]
    for i in range(len(levels) - 1, -1, -1):
        s, dt, g = float(sig[i]), float(sig[i + 1] - sig[i]), float(levels[i])
        a_i = 1 + dt * (kappa + g * g / (2 * s) * (1 + (1 - s) * kappa))
        b_i = dt * c * (1 + g * g * (1 - s) / (2 * s))
        alpha.insert(0, alpha[0] * a_i)
        beta.insert(0, alpha[1] * b_i + beta[0])
    return torch.tensor(alpha, dtype=torch.float64), torch.tensor(beta, dtype=torch.float64)


def _toy(m: int, b: int = 3, seed: int = 0):
    model, sig = LinearFlow(-0.6, 0.4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    levels = torch.tensor([0.9, 0.9, 0.9, 0.0])  # the last step deterministic
    step, group = SAMPLERS["dance_sde"], torch.zeros(b, dtype=torch.long)
    x0 = torch.randn((b, 1), generator=torch.Generator().manual_seed(seed))
    from flowcredit.run.rollout import rollout

    ro = rollout(
        model, torch.zeros(1, 1), group, x0, sig, levels, step, torch.Generator().manual_seed(seed + 1)
    )
    score = lambda images, rows: images.view(-1)  # noqa: E731 (R(x) = x)
    m_states = torch.full((5,), m)
    gen = torch.Generator().manual_seed(seed + 2)
    comp, calls = mc_completions(
        model, torch.zeros(1, 1), group, ro.states, sig, levels, step, score, m_states, gen, 4096
    )
    alpha, beta = closed_form_values(-0.6, 0.4, sig, levels)
    exact = alpha * ro.states[:, :, 0].double() + beta  # (B, N + 1)
    return comp, calls, exact


def test_mc_values_match_the_closed_form_within_their_standard_error():
    comp, calls, exact = _toy(m=4000)
    assert mc_needed(torch.tensor([0.9, 0.9, 0.9, 0.0])).tolist() == [True, True, True, False, False]
    assert calls == 3 * 4000 * (4 + 3 + 2)  # states 0–2 completed, states 3–4 exact
    se = comp.std(-1) / math.sqrt(4000)  # (B, N + 1)
    z = (comp.mean(-1) - exact)[:, :3] / se[:, :3]
    assert z.abs().max() < 4, z
    assert torch.allclose(comp[:, 3:].mean(-1), exact[:, 3:], atol=1e-5)  # exact where deterministic
    # Δ: unbiased as a difference of unbiased estimates, and exact at the deterministic step
    delta_exact = exact[:, 1:] - exact[:, :-1]
    assert torch.allclose(mc_delta(comp)[:, 3], delta_exact[:, 3], atol=1e-5)
    d_a, d_b = split_halves(comp)
    assert torch.allclose((d_a + d_b) / 2, mc_delta(comp), atol=1e-9)


@pytest.mark.parametrize("m", [8, 32])
def test_credit_equal_to_the_true_delta_scores_at_the_noise_ceiling(m):
    """The ceiling (√ of the Spearman–Brown reliability of the halves) is what a perfect rule reaches:
    on 150 groups of 12 the exact Δ's ρ with Δ̂ lies within 0.05 of it at every step (measured: within
    0.03 at M = 8 and M = 32), and it grows with M."""
    comp, _, exact = _toy(m=m, b=12 * 150, seed=5)
    group, trained = torch.arange(150).repeat_interleave(12), torch.tensor([True, True, True, False])
    d_a, d_b = split_halves(comp)
    rho = group_step_spearman(exact[:, 1:] - exact[:, :-1], mc_delta(comp), group, trained).nanmean(0)
    half = group_step_spearman(d_a, d_b, group, trained, constant_credit_is_zero=False).nanmean(0)
    ceiling = spearman_brown(half).sqrt()
    assert (rho - ceiling).abs().max() < 0.05, (rho, ceiling)
    assert (rho < 0.97).all() and (rho > {8: 0.65, 32: 0.85}[m]).all()


def test_audit_leaves_the_model_and_foreign_generators_untouched(tmp_path):
    import random

    import numpy as np
    from loop_probes import small_config, small_model

    from flowcredit.models import load_model
    from flowcredit.run.audit import audit_group, audit_rules
    from flowcredit.run.session import build_reward
    from flowcredit.tasks.shapes import load_prompts

    cfg = small_config("flow_grpo", tmp_path / "r", checkpoint=small_model(tmp_path / "m"), group_size=4)
    model, reward = load_model(cfg), build_reward(cfg, cfg.reward)
    before = {k: v.clone() for k, v in model.net.state_dict().items()}
    states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    a = audit_group(model, cfg, reward, load_prompts("test")[:1], audit_rules(), 2, grads=True)
    assert torch.equal(torch.get_rng_state(), states[0]) and (np.random.get_state()[1] == states[1]).all()
    assert random.getstate() == states[2]
    assert all(torch.equal(before[k], v) for k, v in model.net.state_dict().items())
    assert a.completions.shape == (4, cfg.num_steps + 1, 2) and set(a.credit) >= {"flow_grpo", "dense"}
    again = audit_group(model, cfg, reward, load_prompts("test")[:1], audit_rules(), 2)
    assert torch.equal(a.completions, again.completions)  # its own generators: the same draws
    assert set(a.cosine) == {*a.credit, "noise_halves"} and all(-1 <= c <= 1 for c in a.cosine.values())


def test_gradient_cosine_of_the_step_effects_themselves_is_one(tmp_path):
    """``g_A`` is linear in the credit: A = Δ̂ gives cosine 1, −Δ̂ gives −1, 3·Δ̂ gives 1, and a credit
    that differs from Δ̂ only on an untrained step changes nothing."""
    from loop_probes import small_config, small_model

    from flowcredit.models import load_model
    from flowcredit.run.audit import gradient_cosines
    from flowcredit.run.rollout import noise_levels, rollout
    from flowcredit.schedule import sigmas

    cfg = small_config("flow_grpo", tmp_path / "r", checkpoint=small_model(tmp_path / "m"), group_size=3)
    model = load_model(cfg)
    sig, (levels, trained) = sigmas(cfg.num_steps, cfg.shift), noise_levels(cfg, None)
    group, gen = torch.zeros(3, dtype=torch.long), torch.Generator().manual_seed(0)
    cond, x0 = model.encode(["a red circle"]), torch.randn((3, *model.latent_shape), generator=gen)
    ro = rollout(model, cond, group, x0, sig, levels, SAMPLERS[cfg.sampler], gen)
    delta = torch.randn((3, cfg.num_steps), generator=gen)
    other = delta.clone()
    other[:, ~trained] = 5.0
    credits = {"same": delta, "neg": -delta, "scaled": 3 * delta, "untrained_differs": other}
    step = (cond, group, ro.states, sig, levels, SAMPLERS[cfg.sampler])
    cos = gradient_cosines(model, cfg, step, credits, delta, trained, (delta, -delta))
    assert cos["same"] == pytest.approx(1, abs=1e-9) and cos["neg"] == pytest.approx(-1, abs=1e-9)
    assert cos["scaled"] == pytest.approx(1, abs=1e-9) and cos["untrained_differs"] == pytest.approx(
        1, abs=1e-9
    )
    assert cos["noise_halves"] == pytest.approx(-1, abs=1e-9)


def test_audit_command_writes_every_statistic_and_resumes(tmp_path, capsys):
    import json

    from loop_probes import small_model

    from flowcredit.commands.audit import main

    argv = ["--checkpoint", small_model(tmp_path / "m"), "--num_steps", "6", "--group_size", "4"]
    argv += ["--reward", "reward_fixtures:brightness"]  # a reward with a signal on a random model
    argv += ["--max-prompts", "2", "--m", "4", "--out", str(tmp_path / "a")]
    assert main(argv) == 0
    report = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert report["steps"] == [0, 1, 2, 3, 4] and report["settings"]["m"] == [4] * 5 + [1, 1]
    for name in ("flow_grpo", "dense", "dense_euler1", "stepwise", "turning_point"):
        rule = report["rules"][name]
        assert len(rule["spearman"]["per_step"]) == len(rule["spearman"]["per_step_interval"]) == 5
        assert len(rule["sign_agreement"]["per_step"]) == 5 and "value_calls_per_trajectory" in rule
    assert report["rules"]["flow_grpo"]["value_calls_per_trajectory"] == 0
    assert report["rules"]["dense"]["value_calls_per_trajectory"] > 0
    assert all(math.isfinite(v) for v in report["rules"]["dense"]["spearman"]["per_step"])
    assert len(report["ceiling"]["spearman_ceiling"]) == 5 and report["mc_calls_per_trajectory"] > 0
    assert (tmp_path / "a" / "audit.png").is_file()
    (tmp_path / "a" / "audit.json").unlink()
    assert main(argv) == 0  # read back from groups/, the same report
    again = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert again["rules"] == report["rules"] and again["ceiling"] == report["ceiling"]
    assert set(report["gradient_cosine"]) >= {"flow_grpo", "noise_halves"}
    assert again["gradient_cosine"] == report["gradient_cosine"]
    assert "policy-gradient cosine" in capsys.readouterr().out


def test_audit_of_a_published_runs_tensors_is_the_audit_of_its_own_snapshot(tmp_path):
    """``--checkpoint PUB/iteration-K`` (trainable tensors only, as the bench publishes them) audits the
    same weights as the run's own exported snapshot: the same completions, bit for bit."""
    from loop_probes import small_config, small_model
    from safetensors.torch import load_file

    from flowcredit.commands.audit import main
    from flowcredit.commands.bench_skill import publish
    from flowcredit.train import train

    cfg = small_config(
        "flow_grpo", tmp_path / "runs/r", checkpoint=small_model(tmp_path / "m"), snapshot_every=1
    )
    train(cfg)
    publish(tmp_path / "runs/r", tmp_path / "pub")
    common = [
        "--num_steps",
        "6",
        "--group_size",
        "3",
        "--max-prompts",
        "1",
        "--m",
        "2",
        "--grad-prompts",
        "0",
    ]
    common += ["--reward", "reward_fixtures:brightness"]
    for name, weights in (
        ("own", tmp_path / "runs/r/snapshots/iteration-0001"),
        ("pub", tmp_path / "pub/r/iteration-0001"),
    ):
        assert main([*common, "--checkpoint", str(weights), "--out", str(tmp_path / name)]) == 0
    own, pub = (load_file(tmp_path / n / "groups/0000.safetensors") for n in ("own", "pub"))
    assert torch.equal(own["completions"], pub["completions"])


def test_an_audit_gains_a_rule_without_its_completions_recomputed(tmp_path, monkeypatch):
    """An audit stored with fewer rules, asked again with one more: the stored completions are kept
    (no Monte-Carlo call runs), the new rule's credit and gradient cosine equal those of an audit run
    with every rule from the start; a stored audit whose trajectories are not the ones drawn again is
    refused."""
    import json

    from loop_probes import small_model

    from flowcredit.commands.audit import main
    from flowcredit.run import audit as audit_mod

    argv = ["--checkpoint", small_model(tmp_path / "m"), "--num_steps", "6", "--group_size", "4"]
    argv += [
        "--reward",
        "reward_fixtures:brightness",
        "--max-prompts",
        "2",
        "--m",
        "4",
        "--grad-prompts",
        "1",
    ]
    assert main([*argv, "--rules", "flow_grpo,dense_euler1,coca", "--out", str(tmp_path / "all")]) == 0
    assert main([*argv, "--rules", "flow_grpo,dense_euler1", "--out", str(tmp_path / "part")]) == 0
    before = json.loads((tmp_path / "part" / "audit.json").read_text())
    monkeypatch.setattr(audit_mod, "mc_completions", lambda *a, **k: pytest.fail("completions recomputed"))
    assert main([*argv, "--rules", "flow_grpo,dense_euler1,coca", "--out", str(tmp_path / "part")]) == 0
    full, grown = (json.loads((tmp_path / d / "audit.json").read_text()) for d in ("all", "part"))
    assert grown["rules"]["coca"] == full["rules"]["coca"] and grown["rules"] == full["rules"]
    assert grown["gradient_cosine"]["coca"]["mean"] == pytest.approx(
        full["gradient_cosine"]["coca"]["mean"], abs=1e-9
    )
    assert grown["settings"]["rules"] == full["settings"]["rules"]
    # the audit's own minutes and provenance kept, this run's beside them
    assert grown["minutes"] == before["minutes"] and grown["provenance"] == before["provenance"]
    assert [step["rules"] for step in grown["rules_added"]] == [["coca"]]
    # stored trajectories that are not the ones drawn again: refused, naming the rule
    from safetensors.torch import load_file, save_file

    path = tmp_path / "part" / "groups" / "0000.safetensors"
    t = load_file(str(path))
    t["credit.flow_grpo"] = t["credit.flow_grpo"] + 0.01
    del t["credit.coca"]
    save_file(t, str(path))
    meta_path = path.with_suffix(".json")
    meta = json.loads(meta_path.read_text())
    meta["nfe"].pop("coca")
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'flow_grpo' recomputed differs"):
        main([*argv, "--rules", "flow_grpo,dense_euler1,coca", "--out", str(tmp_path / "part")])
