"""CFG's unconditional branch with ``cfg_uncond_grad`` off (Flow-GRPO's gradient): a constant of the
gradient, so under gradient it runs as its own pass of B rows without a graph, or is taken from the
rollout (``FlowModelBase.guided_pair``, ``keep_uncond``, ``uncond_given``) while the weights are still
the rollout's; the update's result is the same to float round-off and its network calls fewer."""

from __future__ import annotations

import pytest
import torch
from loop_probes import small_session

import flowcredit.train as loop
from flowcredit.models import FlowModelBase
from flowcredit.run.session import Session


class Probe(FlowModelBase):
    """``guided_pair``'s callers, counted."""

    def __init__(self, cfg_uncond_grad: bool):
        self.cfg_uncond_grad, self.calls = cfg_uncond_grad, []
        self.w = torch.tensor(2.0, requires_grad=True)

    def pair(self):
        def joint():
            self.calls.append("joint")
            return self.w * torch.ones(2), self.w * torch.full((2,), 3.0)

        def cond_only():
            self.calls.append("cond")
            return self.w * torch.ones(2)

        def uncond_only():
            self.calls.append("uncond")
            return self.w * torch.full((2,), 3.0)

        return self.guided_pair(joint, cond_only, uncond_only)


def test_guided_pair_geometry_by_hand():
    on = Probe(True)
    v_cond, v_uncond = on.pair()
    assert on.calls == ["joint"] and v_uncond.requires_grad  # the default: gradient through both
    off = Probe(False)
    v_cond, v_uncond = off.pair()
    assert off.calls == ["uncond", "cond"] and v_cond.requires_grad and not v_uncond.requires_grad
    assert torch.equal(v_uncond, torch.full((2,), 6.0))
    off.calls, off.uncond_given = [], torch.tensor([7.0, 8.0])
    v_cond, v_uncond = off.pair()
    assert off.calls == ["cond"] and torch.equal(v_uncond, torch.tensor([7.0, 8.0]))  # no pass
    off.calls, off.uncond_given, off.uncond_record = [], None, []
    with torch.no_grad():
        off.pair()
    assert off.calls == ["joint"] and torch.equal(off.uncond_record[0], torch.full((2,), 6.0))


def _iteration(
    tmp_path, name: str, reuse: bool, monkeypatch, per_update: int = 20
) -> tuple[dict, list, dict]:
    """Iteration 0 of Flow-GRPO with ``cfg_uncond_grad`` off, ``per_update`` trained steps per
    optimizer step (20: all of them, one step); returns its metrics, the rollout's unconditional
    velocities (or None) and the trained LoRA."""
    seen = []
    real = loop.ppo_update

    def spy(s, plan, levels, sam, *args):
        seen.append(sam.ro.uncond)
        return real(s, plan, levels, sam, *args)

    monkeypatch.setattr(loop, "ppo_update", spy)
    if not reuse:
        monkeypatch.setattr(Session, "reuses_uncond", property(lambda self: False))
    s = small_session(
        "flow_grpo", tmp_path / name, cfg_uncond_grad=False, steps_per_update=per_update, beta=0.0
    )
    metrics = loop.grpo_iteration(s, 0)
    monkeypatch.undo()
    return metrics, seen, s.policy.trainable_state()


@pytest.mark.usefixtures("one_thread")
def test_the_update_reuses_the_rollouts_unconditional_velocity(tmp_path, monkeypatch):
    """Reused (the first optimizer step's micro-batches) or recomputed, the update moves the LoRA to
    the same weights to float round-off; the rollout's records are the batch's ``(B, N, …)``, and
    the reused passes are not counted as network calls (``nfe/train``: one pass per row, not two)."""
    got, seen, lora = _iteration(tmp_path, "reuse", True, monkeypatch)
    want, seen_off, lora_off = _iteration(tmp_path, "off", False, monkeypatch)
    ro_uncond = seen[0]
    assert seen_off == [None] and ro_uncond is not None
    assert ro_uncond.shape[:2] == (12, 5) and torch.isfinite(ro_uncond).all()
    assert got["reward/mean"] == want["reward/mean"]  # the same rollout
    assert got["stats/optimizer_steps"] == want["stats/optimizer_steps"] == 1
    assert got["nfe/train"] * 2 == want["nfe/train"]  # every trained row reused its pass
    moved = max((lora[k] - lora_off[k]).abs().max().item() for k in lora)
    step = max((lora_off[k] - s0).abs().max().item() for k, s0 in _initial(tmp_path).items())
    assert step > 0 and moved <= 1e-4 * step + 1e-8
    assert got["stats/first_ratio_maxdev"] < 1e-5


@pytest.mark.usefixtures("one_thread")
def test_after_the_first_optimizer_step_the_update_runs_the_unconditional_pass(tmp_path, monkeypatch):
    """One trained step per optimizer step: only the first step's rows reuse the rollout's velocity
    (the weights have moved after it), so ``nfe/train`` drops by those 12 rows' passes only, and the
    LoRA ends where the run without reuse ends, to float round-off."""
    got, _, lora = _iteration(tmp_path, "reuse", True, monkeypatch, per_update=1)
    want, _, lora_off = _iteration(tmp_path, "off", False, monkeypatch, per_update=1)
    steps = want["stats/optimizer_steps"]  # the trained steps, one optimizer step each
    assert got["stats/optimizer_steps"] == steps >= 2
    assert want["nfe/train"] == 12 * steps * 2 and got["nfe/train"] == want["nfe/train"] - 12
    step = max((lora_off[k] - s0).abs().max().item() for k, s0 in _initial(tmp_path).items())
    assert max((lora[k] - lora_off[k]).abs().max().item() for k in lora) <= 1e-4 * step + 1e-8


def _initial(tmp_path) -> dict:
    return small_session("flow_grpo", tmp_path / "init", cfg_uncond_grad=False).policy.trainable_state()


def test_an_adapter_that_records_nothing_reuses_nothing():
    """An adapter of its own (``FlowModelBase`` without ``guided_pair``) records no unconditional
    velocity: the rollout keeps none, and the update runs its passes as before."""
    from flowcredit.run.rollout import recorded_velocity

    class Own(FlowModelBase):
        def velocity(self, x, sigma, cond):
            return 2 * x

    model, x = Own(), torch.ones(3, 2)
    v, uncond = recorded_velocity(
        model, x, torch.ones(3), torch.zeros(1, 4), torch.zeros(3, dtype=torch.long), 2
    )
    assert torch.equal(v, 2 * x) and uncond is None and model.uncond_record is None
