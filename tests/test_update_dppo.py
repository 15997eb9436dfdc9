"""Flow-DPPO's update rule ``dppo`` (issue 60): the loss by hand on 3 rows (the divergence also by
``torch.distributions``), its trust region (no gradient outside it for a row moved further in its
advantage's direction, the plain policy gradient inside), its options and their errors, and the preset
``flow_dppo`` in the loop: the first micro-batch's loss is the rule's on the rows re-scored through the
model, and a run killed in a checkpoint write resumes exactly."""

from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
from glue_probes import GRID, flow_mean, flow_std, gauss_logp, rollout_of, session, velocity
from kill_points import Killed, install
from loop_probes import perturb_lora, small_config, small_model
from safetensors.torch import load_file

import flowcredit.train as loop
from flowcredit.errors import ConfigError
from flowcredit.presets import PRESETS, load_config
from flowcredit.run.checkpoint import find_checkpoint
from flowcredit.run.rollout import seeded
from flowcredit.train import train
from flowcredit.updates import UPDATES, dppo, dppo_divergence, dppo_masked, resolve_options


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


# The 3-row example (latents 1×1×2): mean shifts, stds, ratios and advantages.
MEAN_OLD = torch.zeros(3, 1, 1, 2)
MEAN_NEW = _t([[0.2, 0.0], [0.1, 0.1], [0.3, -0.3]]).view(3, 1, 1, 2)
STD = _t([0.5, 1.0, 0.5])
# mean_d Δμ² = [.02, .01, .09]; / (2 s²) = [.04, .005, .18]; / 2 only = [.01, .005, .045]
D_KL, D_PLAIN = _t([0.04, 0.005, 0.18]), _t([0.01, 0.005, 0.045])
LOGP_OLD = _t([-1.0, 0.5, 2.0])
RATIO = _t([1.5, 1.5, 0.5])
LOGP_NEW = LOGP_OLD + torch.log(RATIO)
ADV = _t([2.0, 1.0, 4.0])
TAU = 0.03  # far: rows 0 and 2 (KL); row 2 only without the coefficient


def test_divergence_by_hand_and_as_the_gaussian_kl_per_dimension():
    torch.testing.assert_close(dppo_divergence(MEAN_NEW, MEAN_OLD, STD), D_KL)
    torch.testing.assert_close(dppo_divergence(MEAN_NEW, MEAN_OLD, STD, add_kl_coefficient=False), D_PLAIN)
    s = STD.view(3, 1, 1, 1).expand_as(MEAN_NEW)
    for p, q in ((MEAN_OLD, MEAN_NEW), (MEAN_NEW, MEAN_OLD)):  # equal variances: either direction
        kl = torch.distributions.kl_divergence(
            torch.distributions.Normal(p, s), torch.distributions.Normal(q, s)
        )
        torch.testing.assert_close(kl.flatten(1).mean(1), D_KL)


@pytest.mark.parametrize(
    ("sign", "coefficient", "masked", "expected"),
    [
        # row 0 far, r > 1, A > 0: dropped; row 1 near: −1·1.5; row 2 far but r < 1 with A > 0
        # (moving back toward the old policy): kept, −4·.5
        (1, True, [True, False, False], (0.0 - 1.5 - 2.0) / 3),
        # without 1/s²: row 0 near (.01 < .03), kept, −2·1.5
        (1, False, [False, False, False], (-3.0 - 1.5 - 2.0) / 3),
        # mirrored (A → −A, r → 1/r): row 0 far, r < 1, A < 0: dropped; row 1 −(−1)·(2/3);
        # row 2 far, r = 2 > 1 with A < 0: corrective, kept, −(−4)·2
        (-1, True, [True, False, False], (0.0 + 2.0 / 3.0 + 8.0) / 3),
    ],
)
def test_loss_by_hand(sign, coefficient, masked, expected):
    logp_new, adv = LOGP_OLD + sign * torch.log(RATIO), sign * ADV
    opts = dict(kl_mask_threshold=TAU, add_kl_coefficient=coefficient)
    got = dppo_masked(logp_new, LOGP_OLD, MEAN_NEW, MEAN_OLD, STD, adv, **opts)
    assert got.tolist() == masked
    loss = dppo(logp_new, LOGP_OLD, MEAN_NEW, MEAN_OLD, STD, adv, **opts)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_first_ratio_is_never_masked_and_zero_advantage_adds_nothing():
    """At θ = old (r = 1, D = 0) nothing is dropped and the loss is −mean A; A = 0 rows add 0 at any θ."""
    loss = dppo(LOGP_OLD, LOGP_OLD, MEAN_OLD, MEAN_OLD, STD, ADV, kl_mask_threshold=1e-12)
    assert loss.item() == pytest.approx(-ADV.mean().item())
    far = dppo_masked(
        LOGP_OLD, LOGP_OLD, MEAN_NEW, MEAN_OLD, STD, ADV, kl_mask_threshold=TAU, add_kl_coefficient=True
    )
    assert not far.any()  # r = 1 exactly: neither r > 1 nor r < 1
    zero = dppo(LOGP_NEW, LOGP_OLD, MEAN_NEW, MEAN_OLD, STD, torch.zeros(3), kl_mask_threshold=TAU)
    assert zero.item() == 0.0 and UPDATES["dppo"].drops_zero_advantage


def _policy_grad(theta0: torch.Tensor, adv: torch.Tensor, tau: float) -> torch.Tensor:
    """∇θ of the loss for a toy Gaussian policy per row: ``μ_θ = μ_old + θ·u`` with ``u = (1, 1)``, the
    stored ``x' = μ_old + s·(1, 1)``; ``logp`` the averaged Gaussian log-density (§2)."""
    theta = theta0.clone().requires_grad_(True)
    u, x_next = torch.ones(3, 1, 1, 2), MEAN_OLD + STD.view(3, 1, 1, 1)
    mean_new = MEAN_OLD + theta.view(3, 1, 1, 1) * u
    logp_new, logp_old = _logp(x_next, mean_new), _logp(x_next, MEAN_OLD)
    dppo(logp_new, logp_old, mean_new, MEAN_OLD, STD, adv, kl_mask_threshold=tau).backward()
    return theta.grad


def _logp(x_next, mean):
    """The averaged Gaussian log-density ``mean_d[−(x' − μ)²/(2s²)] − log s − ½·log 2π``, ``(3,)``."""
    s = STD.view(3, 1, 1, 1)
    per = -((x_next - mean) ** 2) / (2 * s**2) - torch.log(s) - 0.5 * math.log(2 * math.pi)
    return per.flatten(1).mean(1)


def _plain_grad(theta0: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """The plain policy gradient ``∇θ mean_b(−A·r)`` of the toy policy, written out: ``x' − μ_θ = s − θ``
    in both dims, so ``Δ = logp_new − logp_old = (s² − (s − θ)²)/(2s²)`` and ``∂Δ/∂θ = (s − θ)/s²``."""
    s = STD
    delta = (s**2 - (s - theta0) ** 2) / (2 * s**2)
    return -adv * torch.exp(delta) * (s - theta0) / s**2 / 3


def test_gradient_inside_the_region_is_the_plain_policy_gradient():
    theta0 = _t([0.3, -0.2, 0.1])  # D = θ²/(2s²) = [.18, .02, .02]
    adv = _t([1.0, 1.0, -2.0])
    torch.testing.assert_close(_policy_grad(theta0, adv, tau=1.0), _plain_grad(theta0, adv))


def test_gradient_outside_the_region_is_zero_only_for_a_row_moved_further():
    """Row 0 moved toward x' (r > 1) with A > 0: dropped; row 1 moved away (r < 1) with A > 0 and row 2
    toward with A < 0: moving back, the plain gradient. At τ above every D all three keep it."""
    theta0 = _t([0.3, -0.2, 0.1])
    adv = _t([1.0, 1.0, -2.0])
    got, plain = _policy_grad(theta0, adv, tau=1e-3), _plain_grad(theta0, adv)
    assert got[0].item() == 0.0 and plain[0].item() != 0.0
    torch.testing.assert_close(got[1:], plain[1:])
    # row 0 re-scored with the opposite advantage: moving back, kept
    adv0 = _t([-1.0, 1.0, -2.0])
    torch.testing.assert_close(_policy_grad(theta0, adv0, tau=1e-3), _plain_grad(theta0, adv0))


def test_the_mask_carries_no_gradient():
    mean_new = MEAN_NEW.clone().requires_grad_(True)
    logp_new = LOGP_NEW.clone().requires_grad_(True)
    dppo(logp_new, LOGP_OLD, mean_new, MEAN_OLD, STD, ADV, kl_mask_threshold=TAU).backward()
    assert mean_new.grad is None or not mean_new.grad.any()
    torch.testing.assert_close(logp_new.grad, _t([0.0, -1.0 * 1.5, -4.0 * 0.5]) / 3)  # ∂(−A·e^Δ)/∂Δ / B


def test_bad_shapes_and_std_are_refused():
    with pytest.raises(ValueError, match="dppo: means must be"):
        dppo(LOGP_NEW, LOGP_OLD, MEAN_NEW, MEAN_OLD[:2], STD, ADV)
    with pytest.raises(ValueError, match="dppo: std must be > 0"):
        dppo(LOGP_NEW, LOGP_OLD, MEAN_NEW, MEAN_OLD, torch.zeros(3), ADV)


# --- options ----------------------------------------------------------------------------------


def test_options_resolve_with_the_authors_defaults_and_one_line_errors():
    entry = UPDATES["dppo"]
    assert entry.needs == ("logp", "mean") and not entry.forward and "Flow-DPPO" in entry.doc
    assert resolve_options("dppo") == {"kl_mask_threshold": 1e-5, "add_kl_coefficient": True}
    assert resolve_options("dppo", {"kl_mask_threshold": 1})["kl_mask_threshold"] == 1  # an int for a float
    cases = [
        ({"kl_threshold": 1e-4}, r"'dppo' has no option 'kl_threshold' \(options: add_kl_coefficient, "),
        ({"kl_mask_threshold": 0.0}, "update rule 'dppo': option 'kl_mask_threshold' must be > 0, got 0.0"),
        ({"kl_mask_threshold": "1e-5"}, "option 'kl_mask_threshold' of 'dppo' must be float"),
        ({"add_kl_coefficient": 1}, "option 'add_kl_coefficient' of 'dppo' must be bool, got 1"),
    ]
    for given, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            resolve_options("dppo", given)
        assert "\n" not in str(info.value)


def test_preset_and_options_through_the_config():
    cfg = load_config("flow_dppo", None, ["--update_options", '{"kl_mask_threshold": 2e-5}'])
    assert (cfg.update, cfg.sampler, cfg.noise_level, cfg.credit, cfg.global_std) == (
        "dppo",
        "flow_sde",
        0.7,
        "flow_grpo",
        True,
    )
    from flowcredit.validation import update_options

    assert update_options(cfg) == {"kl_mask_threshold": 2e-5, "add_kl_coefficient": True}
    with pytest.raises(
        ConfigError, match=r"^config field 'update_options': .*'kl_mask_threshold' must be > 0"
    ):
        load_config("flow_dppo", None, ["--update_options", '{"kl_mask_threshold": -1e-5}'])
    with pytest.raises(ConfigError, match="update 'dppo' clips no ratio"):
        load_config("flow_dppo", None, ["--clip_range", "0.01"])


# --- the preset in the loop -------------------------------------------------------------------


def _first_micro_batch(s, batch, plan, levels, sam, adv, monkeypatch):
    """Run ``ppo_update`` and return the rows, step and policy loss of its first micro-batch."""
    first, real = [], loop.step_loss

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        given = inspect.signature(real).bind(*args, **kwargs).arguments
        first.append((given["r"].clone(), given["i"], out["loss/policy"]))
        return out

    monkeypatch.setattr(loop, "step_loss", spy)
    n = len(batch.group)
    loop.ppo_update(s, plan, levels, sam, adv, batch.prompts, torch.arange(n), seeded(s.cfg.seed, 0, 3))
    monkeypatch.setattr(loop, "step_loss", real)
    return first[0]


@pytest.mark.parametrize("region", ["outside", "inside"])
def test_first_micro_batch_is_the_rule_on_rescored_rows(region, tmp_path, monkeypatch):
    """With the policy moved (LoRA B at random), each row's advantage set to the sign of its log-ratio
    for half the rows (moved further) and against it for the other half (moving back): at τ below every
    row's divergence the first micro-batch's loss is ``dppo`` on the re-scored rows with the rollout's
    old means, which drops the first half; at τ above every divergence it is the plain −mean(A·r)."""
    s = session("flow_dppo", tmp_path)
    batch, cond, plan, levels, sam = rollout_of(s)
    ro, a, steps = sam.ro, s.cfg.noise_level, torch.nonzero(plan.trained).flatten().tolist()
    perturb_lora(s, scale=0.2)
    n = len(batch.group)
    assert n == 4 and steps == [0, 1, 2]
    adv, rescored = torch.zeros(n, plan.trained.numel()), {}
    with torch.no_grad():
        for i in steps:
            x, x_next = ro.states[:, i], ro.states[:, i + 1]
            mean = flow_mean(velocity(s, x, GRID[i], cond[batch.group]), x, GRID[i], GRID[i + 1], a)
            std = torch.full((n,), flow_std(GRID[i], GRID[i + 1], a))
            logp = gauss_logp(x_next, mean, std[0].item())
            rescored[i] = (logp, mean, std)
            toward = torch.sign(logp - ro.logp[:, i])
            adv[:, i] = toward * torch.tensor([1.0, -1.0, 2.0, -0.5])  # rows 0, 2 further; 1, 3 back
    divergence = torch.cat([dppo_divergence(m, ro.means[:, i], sd) for i, (_, m, sd) in rescored.items()])
    tau = float(divergence.min()) / 2 if region == "outside" else float(divergence.max()) * 2
    s.cfg.update_options = json.dumps({"kl_mask_threshold": tau})  # read by the loop at every step
    assert s.update_opts["kl_mask_threshold"] == tau
    r, i, loss = _first_micro_batch(s, batch, plan, levels, sam, adv, monkeypatch)
    logp, mean, std = (x[r] for x in rescored[i])
    want = dppo(logp, ro.logp[r, i], mean, ro.means[r, i], std, adv[r, i], kl_mask_threshold=tau)
    plain = (-adv[r, i] * torch.exp(logp - ro.logp[r, i])).mean()
    assert loss == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    masked = dppo_masked(
        logp,
        ro.logp[r, i],
        mean,
        ro.means[r, i],
        std,
        adv[r, i],
        kl_mask_threshold=tau,
        add_kl_coefficient=True,
    )
    if region == "outside":
        assert masked.tolist() == (adv[r, i] > 0).eq(logp > ro.logp[r, i]).tolist() and masked.any()
        dropped = (-adv[r, i] * torch.exp(logp - ro.logp[r, i]))[masked].sum() / len(r)
        assert dropped.abs() > 1e-3 and loss == pytest.approx((plain - dropped).item(), rel=1e-5, abs=1e-7)
    else:
        assert not masked.any() and loss == pytest.approx(plain.item(), rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return small_model(tmp_path_factory.mktemp("model") / "tiny16")


def test_preset_trains_and_resumes_exactly(tiny_model, tmp_path, monkeypatch):
    """Two iterations of ``flow_dppo`` on the small random model, and the same run killed in the
    checkpoint write of iteration 2 then resumed: the same metrics and final weights, bit for bit."""
    extra = dict(checkpoint=tiny_model, iterations=2, eval_every=2, ema_decay=0.9)
    full, broken = tmp_path / "full", tmp_path / "broken"
    train(small_config("flow_dppo", full, **extra))
    rows = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "loss/policy" in row]
    assert len(trained) == 2 and all(math.isfinite(row["loss/policy"]) for row in trained)
    cfg = small_config("flow_dppo", broken, **extra)
    install("before_swap", 2, "raise", monkeypatch.setattr)
    with pytest.raises(Killed):
        train(cfg)
    monkeypatch.undo()
    assert json.loads((find_checkpoint(broken) / "state.json").read_text())["iteration"] == 1
    train(cfg, resume=True)
    assert (broken / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()
    want, got = (load_file(d / "final" / "trainable.safetensors") for d in (full, broken))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert any(want[k].abs().max() > 0 for k in want if "lora_B" in k), "the run never moved"


def test_preset_is_registered_outside_the_bench_comparison():
    from flowcredit.presets import COMPARED_PRESETS

    assert "flow_dppo" in PRESETS and "flow_dppo" not in COMPARED_PRESETS


def test_clipfrac_is_the_masked_fraction():
    """``stats/clipfrac`` of ``dppo`` is the fraction of rows it masks (the entry's hook), by hand: of
    two rows outside the region, the one moved in its advantage's direction is masked."""
    from flowcredit.updates import UPDATES

    mean_old = torch.zeros(2, 1)
    mean_new = torch.tensor([[0.1], [0.1]])  # D = 0.01 / 2 = 5e-3 ≥ τ for both
    given = dict(
        logp_new=torch.tensor([0.2, 0.2]),  # r > 1 for both
        logp_old=torch.zeros(2),
        mean_new=mean_new,
        mean_old=mean_old,
        std=torch.ones(2),
        adv=torch.tensor([1.0, -1.0]),  # row 0 moved in its advantage's direction: masked; row 1 not
    )
    fraction = UPDATES["dppo"].clipfrac(**given, kl_mask_threshold=1e-5, add_kl_coefficient=True)
    assert fraction.item() == 0.5


def test_the_skill_arm_is_the_preset_with_the_dppo_update_at_its_network_calls():
    """The pre-registered arm (docs/benchmarks.md, "Flow-DPPO's claim") changes the update rule only and
    runs the preset's 450 iterations: the old policy's means come from the rollout, no call more."""
    from flowcredit.commands.bench_skill import SKILL_ARMS, SKILL_CLAIMS, nominal_calls
    from flowcredit.presets import load_config

    base = load_config("skill")
    arm = load_config("skill", None, SKILL_ARMS["dppo"])
    assert {k: v for k, v in vars(arm).items() if getattr(base, k) != v} == {"update": "dppo"}
    assert nominal_calls(arm) == nominal_calls(base) and arm.iterations == 450
    claim = ("skill-dppo", "Flow-DPPO: at least as good as Flow-GRPO at equal network calls", "noninferior")
    assert claim in SKILL_CLAIMS
