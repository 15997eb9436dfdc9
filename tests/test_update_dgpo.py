"""DGPO's update rule (flowcredit/update_dgpo.py): the group-preference loss against hand-computed tiny
tensors and against the DPO log-sigmoid written out by hand, the group weighting, the PPO-style clip,
the shared times, one noise per group, and the registry entry's capabilities."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowcredit.run.forward_update import fresh_noise
from flowcredit.updates import UPDATES, dgpo, dgpo_group_weights, dgpo_times, register_update, resolve_options


def _sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _case():
    """3 rows of 2 dims: clean 0, noise 1 (target 1); errors θ (0, 1, 1), reference (½, ½, ½)."""
    clean, noise = torch.zeros(3, 2), torch.ones(3, 2)
    v = torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]], requires_grad=True)
    v_ref = torch.tensor([[1.0, 0.0]] * 3)
    adv, group, t = torch.tensor([1.0, -1.0, 2.0]), torch.tensor([0, 0, 1]), torch.full((3,), 0.5)
    return dict(
        v_theta=v, v_old=v.detach().clone(), v_ref=v_ref, clean=clean, noise=noise, t=t, adv=adv, group=group
    )


def test_loss_against_hand_computation():
    # s_0 = ½·(1·(0 − ½) + (−1)·(1 − ½)) = −½, s_1 = 2·(1 − ½) = 1 (β_dpo = 1)
    # loss = mean(σ(−½)·1·0, σ(−½)·(−1)·1, σ(1)·2·1)
    got = dgpo(**_case(), beta_dpo=1.0, clip_range=0.0)
    want = (-_sig(-0.5) + 2 * _sig(1.0)) / 3
    assert got.item() == pytest.approx(want, rel=1e-6)
    w = dgpo_group_weights(
        torch.tensor([0.0, 1.0, 1.0]), torch.full((3,), 0.5), _case()["adv"], _case()["group"], 1.0
    )
    assert w.tolist() == pytest.approx([_sig(-0.5), _sig(-0.5), _sig(1.0)], rel=1e-6)


@pytest.mark.parametrize("beta_dpo", [1.0, 100.0])
def test_gradient_is_the_group_dpo_loss_gradient(beta_dpo):
    """∇ loss = (1/B)·Σ_g (n_g/β)·∇[−log σ(−s_g)], with −log σ(−s) = log(1 + eˢ) written by hand."""
    torch.manual_seed(0)
    b = 6
    clean, noise = torch.randn(b, 3), torch.randn(b, 3)
    v = (noise - clean + 0.3 * torch.randn(b, 3)).requires_grad_()
    v_ref = noise - clean + 0.3 * torch.randn(b, 3)
    adv, group = torch.randn(b), torch.tensor([5, 5, 5, 2, 2, 9])
    case = dict(
        v_old=v.detach(), v_ref=v_ref, clean=clean, noise=noise, t=torch.rand(b), adv=adv, group=group
    )
    (g_rule,) = torch.autograd.grad(dgpo(v_theta=v, **case, beta_dpo=beta_dpo, clip_range=0.0), v)

    err = ((v - (noise - clean)) ** 2).mean(dim=1)  # (B,)
    err_ref = ((v_ref - (noise - clean)) ** 2).mean(dim=1)
    total = torch.zeros(())
    for g in group.unique():
        rows = group == g
        n_g = int(rows.sum())
        s_g = beta_dpo / n_g * (adv[rows] * (err[rows] - err_ref[rows])).sum()
        total = total + n_g / beta_dpo * torch.log(1.0 + torch.exp(s_g))
    (g_hand,) = torch.autograd.grad(total / b, v)
    assert torch.allclose(g_rule, g_hand, rtol=1e-5, atol=1e-7)


def test_groups_do_not_interact_and_ids_are_labels():
    case = _case()
    base = dgpo(**case, beta_dpo=1.0, clip_range=0.0)
    relabelled = dgpo(**case | {"group": torch.tensor([7, 7, 3])}, beta_dpo=1.0, clip_range=0.0)
    assert torch.equal(base, relabelled)
    ref = case["v_ref"].clone()
    ref[2] = torch.tensor([5.0, 5.0])  # group 1's reference: group 0's weights stay
    w0 = dgpo_group_weights(
        torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), case["adv"], case["group"], 1.0
    )
    w1 = dgpo_group_weights(
        torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.5, 0.5, 12.5]), case["adv"], case["group"], 1.0
    )
    assert torch.equal(w0[:2], w1[:2]) and w0[2] != w1[2]


def test_zero_advantage_group_and_single_member_group():
    case = _case() | {"adv": torch.tensor([0.0, 0.0, 2.0])}
    loss = dgpo(**case, beta_dpo=1.0, clip_range=0.0)
    assert loss.item() == pytest.approx(_sig(1.0) * 2 * 1.0 / 3, rel=1e-6)  # group 0 adds 0
    (grad,) = torch.autograd.grad(loss, case["v_theta"])
    assert torch.equal(grad[:2], torch.zeros(2, 2))  # no gradient from the zero-advantage group
    w = dgpo_group_weights(
        torch.tensor([0.0, 1.0, 1.0]), torch.full((3,), 0.5), case["adv"], case["group"], 1.0
    )
    assert w[:2].tolist() == [0.5, 0.5]  # σ(0)
    # the single-member group 1: n_g = 1, s = β·A·(ℓ − ℓ_ref) = 2·½
    assert w[2].item() == pytest.approx(_sig(1.0))


def test_clip_keeps_the_value_and_drops_the_gradient():
    case = _case()
    old = case["v_theta"].detach().clone()
    old[2] = torch.tensor([3.0, 0.0])  # ℓ_old = (4 + 1)/2 = 2.5 > ℓ = 1: r = e^{1.5} > 1 + ε with A > 0
    clipped = dgpo(**case | {"v_old": old}, beta_dpo=1.0, clip_range=1e-2)
    plain = dgpo(**case, beta_dpo=1.0, clip_range=1e-2)  # v_old = v_θ: r = 1, nothing clipped
    assert torch.equal(clipped, plain)
    (g_clip,) = torch.autograd.grad(clipped, case["v_theta"])
    (g_plain,) = torch.autograd.grad(plain, case["v_theta"])
    assert torch.equal(g_clip[2], torch.zeros(2)) and g_plain[2].abs().sum() > 0
    assert torch.equal(g_clip[:2], g_plain[:2])


def test_times_are_shared_distinct_and_truncated():
    sigmas = torch.linspace(1.0, 0.0, 11)  # N = 10
    t = dgpo_times(sigmas, 5, torch.Generator().manual_seed(0), time_draws=4, time_fraction=0.5)
    assert t.shape == (4, 5) and torch.equal(t, t[:, :1].expand(4, 5))
    assert len(set(t[:, 0].tolist())) == 4 and set(t[:, 0].tolist()) <= set(sigmas[:5].tolist())
    short = dgpo_times(
        torch.linspace(1.0, 0.0, 5), 2, torch.Generator().manual_seed(0)
    )  # N = 4: indices 0, 1
    assert sorted(short[:, 0].tolist()) == [0.75, 1.0]
    with pytest.raises(ValueError, match="no step index"):
        dgpo_times(sigmas, 2, time_fraction=0.05)


def test_one_noise_per_group():
    rule = UPDATES["dgpo"]
    noise = fresh_noise(rule, torch.Generator().manual_seed(0), 2, 6, (3,), 3)  # (K, B, …), 2 groups of 3
    assert noise.shape == (2, 6, 3)
    assert torch.equal(noise[:, 0], noise[:, 2]) and torch.equal(noise[:, 3], noise[:, 5])
    assert not torch.equal(noise[:, 0], noise[:, 3]) and not torch.equal(noise[0], noise[1])
    per_row = fresh_noise(UPDATES["awm"], torch.Generator().manual_seed(0), 2, 6, (3,), 3)
    assert torch.equal(per_row, torch.randn((2, 6, 3), generator=torch.Generator().manual_seed(0)))


def test_registry_entry():
    entry = UPDATES["dgpo"]
    assert entry.forward and entry.group_noise and entry.drops_zero_advantage
    assert entry.inputs() == ("clean", "noise", "t", "v_theta", "v_old", "v_ref", "group")
    assert entry.calls(0.0) == 3 and UPDATES["awm"].calls(0.0) == 2 and UPDATES["awm"].calls(0.1) == 3
    fn_opts, time_opts, decay_opts = entry.split(resolve_options("dgpo"))
    assert fn_opts == {"beta_dpo": 100.0, "clip_range": 1e-2}
    assert time_opts == {"time_draws": 4, "time_fraction": 0.5}
    assert decay_opts == {"old_decay_max": 0.3, "old_decay_rate": 0.001, "old_decay_flat": 0}
    with pytest.raises(ValueError, match="beta_dpo' must be > 0"):
        resolve_options("dgpo", {"beta_dpo": 0.0})


def test_group_and_group_noise_are_for_forward_rules():
    def rule(logp_new, logp_old, adv, group):
        return (adv * (logp_new - logp_old)).mean()

    with pytest.raises(ValueError, match="reverse-process rule"):
        register_update("x_grouped", rule, ("logp", "group"))
    with pytest.raises(ValueError, match="group_noise"):
        register_update("x_grouped", lambda logp_new, logp_old, adv: adv.mean(), ("logp",), group_noise=True)
    assert "x_grouped" not in UPDATES


SMALL = [
    *("--iterations", "1", "--prompts_per_iter", "2", "--group_size", "4", "--num_train_prompts", "2"),
    *("--num_eval_prompts", "1", "--eval_samples_per_prompt", "1", "--eval_every", "0", "--num_steps", "4"),
    *("--batch_size", "8", "--log_with", "none", "--reward", "reward_fixtures:brightness"),
]


def test_update_velocities_at_train_guidance_scale(tmp_path, monkeypatch):
    """``train_guidance_scale 1`` (the dgpo preset, as DGPO's code): every velocity of the update is the
    conditional one, one pass per row, while the rollout keeps the model's CFG (2.0), restored after;
    the logged ``nfe/train`` counts that one pass, as the skill bench's ``nominal_calls`` does."""
    from flowcredit.commands.bench_skill import nfe_parts, nominal_calls
    from flowcredit.models.tiny import TinyFlowModel
    from flowcredit.presets import load_config
    from flowcredit.train import train

    seen = []  # (guidance, rows) of each velocity call
    velocity = TinyFlowModel.velocity

    def spy(self, x, sigma, cond):
        seen.append((self.guidance_scale, x.shape[0]))
        return velocity(self, x, sigma, cond)

    monkeypatch.setattr(TinyFlowModel, "velocity", spy)
    cfg = load_config("dgpo", None, [*SMALL, "--run_dir", str(tmp_path / "run")])
    assert cfg.train_guidance_scale == 1.0
    train(cfg)
    at_one = [rows for w, rows in seen if w == 1.0]
    assert {w for w, _ in seen} == {2.0, 1.0}
    # K = 2 draws (steps 0–1 of 4) × 8 rows × θ, old policy, reference (β = 0.02)
    assert sum(at_one) == 2 * 8 * 3
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = next(m for m in metrics if "nfe/train" in m)
    assert logged["nfe/train"] == 2 * 8 * 3 == nfe_parts(cfg)["update"] * 8
    parts = nfe_parts(cfg)
    assert nominal_calls(cfg) == 2 * (parts["rollout"] + parts["values"]) + parts["update"]
    assert logged["nfe/rollout"] == 2 * parts["rollout"] * 8  # CFG: 2 passes per row


def test_train_guidance_scale_is_for_forward_rules():
    from flowcredit.errors import ConfigError
    from flowcredit.presets import load_config

    with pytest.raises(ConfigError, match="train_guidance_scale"):
        load_config("flow_grpo", None, ["--train_guidance_scale", "1"])
    with pytest.raises(ConfigError, match="train_guidance_scale"):
        load_config("dgpo", None, ["--train_guidance_scale", "-1"])


def test_guidance_at_sets_and_restores():
    """``guidance_at``: a weight (0 included: Z-Image's "no CFG", which ``flowcredit eval --cfg 0``
    asks for) inside the block, ``None`` leaves the model's, restored after an error too."""
    from types import SimpleNamespace

    from flowcredit.models.protocol import guidance_at

    model = SimpleNamespace(guidance_scale=4.5)
    with guidance_at(model, 0.0):
        assert model.guidance_scale == 0.0
    with guidance_at(model, None):
        assert model.guidance_scale == 4.5
    with pytest.raises(RuntimeError), guidance_at(model, 1.0):
        assert model.guidance_scale == 1.0
        raise RuntimeError
    assert model.guidance_scale == 4.5
