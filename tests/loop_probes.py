"""Helpers of the loop tests (test_direction.py, test_loop_values.py, test_psi_run.py): a small
session of any preset with a hand-made reward, a spy that records what one real iteration of
``flowcredit.train.grpo_iteration`` computed, and an independent re-scoring of recorded transitions."""

from __future__ import annotations

import dataclasses

import torch

import flowcredit.train as loop
from flowcredit.config import Config, from_dict
from flowcredit.models.tiny import TinyFlowModel, load_builtin
from flowcredit.presets import PRESETS
from flowcredit.run.session import Session, build_session
from flowcredit.validation import validate

SMALL_RUN = dict(
    iterations=2,
    prompts_per_iter=2,
    group_size=6,
    num_train_prompts=4,
    num_eval_prompts=2,
    eval_samples_per_prompt=2,
    eval_every=0,
    num_steps=5,
    window_size=0,
    batch_size=12,
)
"""The test-size run of the built-in task (2 iterations of 2 groups of 6, 5 steps)."""

SMALL = {**SMALL_RUN, "log_with": "none", "reward": "reward_fixtures:brightness"}


def small_model(directory) -> str:
    """Write a randomly initialised tiny model with about a sixteenth of the built-in one's convolution
    arithmetic (16×16 images, 16 base channels, two U-Net levels; the built-in vocabulary) to
    ``directory``; returns the path for ``checkpoint``. For tests whose claim does not depend on the
    weights (exact resume)."""
    builtin = load_builtin()
    config = dataclasses.replace(builtin.config, size=16, channels=16, mults=(1, 2))
    TinyFlowModel(config, seed=0).save(directory)
    return str(directory)


def small_config(preset: str, run_dir, **extra) -> Config:
    """``preset`` at test size (5 steps, 2 groups of 6, the brightness reward), with ``extra`` on top."""
    fields = {**SMALL, "run_dir": str(run_dir)}
    if preset == "stepwise_grpo":
        fields["window_start"] = 1
    if preset == "dense_grpo":
        fields.update(calib_max_iters=1, calib_groups=1)
    return validate(from_dict({**fields, **extra}, PRESETS[preset]()))


def small_session(preset: str, run_dir, **extra) -> Session:
    return build_session(small_config(preset, run_dir, **extra))


def record_iteration(s: Session, monkeypatch, it: int = 0) -> tuple[dict, dict]:
    """Run the real ``grpo_iteration(s, it)``, recording the values it computed and what it handed
    to the update (``ro``, ``adv``, ``group``, ``keep``, ``prompts``, and the trainable weights
    before the update, ``policy_before_update``). Returns ``(seen, metrics)``."""
    seen: dict = {}
    real_values, real_update = loop.state_values, loop.ppo_update

    def values_spy(*args, **kwargs):
        values, nfe = real_values(*args, **kwargs)
        seen["values"] = values.clone()
        return values, nfe

    def update_spy(s_, plan, levels, sam, adv, prompts, keep, gen):
        seen.update(
            ro=sam.ro, adv=adv.clone(), prompts=list(prompts), group=sam.group.clone(), keep=keep.clone()
        )
        seen.update(plan=plan, levels=levels.clone(), sampled=sam)
        seen["policy_before_update"] = s_.policy.trainable_state()
        return real_update(s_, plan, levels, sam, adv, prompts, keep, gen)

    monkeypatch.setattr(loop, "state_values", values_spy)
    monkeypatch.setattr(loop, "ppo_update", update_spy)
    metrics = loop.grpo_iteration(s, it)
    monkeypatch.setattr(loop, "state_values", real_values)
    monkeypatch.setattr(loop, "ppo_update", real_update)
    return seen, metrics


@torch.no_grad()
def perturb_lora(s: Session, scale: float = 0.05, seed: int = 0) -> None:
    """Draw every LoRA B at random (``scale``·N(0, 1)): the policy then differs from the reference."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in s.model.net.named_parameters():
        if "lora_B" in name:
            p.copy_(scale * torch.randn(p.shape, generator=gen))


@torch.no_grad()
def transition_logp(s: Session, ro, prompts: list[str], group: torch.Tensor) -> torch.Tensor:
    """``(B, N)`` log-density of every recorded transition ``x_i → x_{i+1}`` under the session's
    current policy, one step at a time on all rows (0 off the trained steps)."""
    cond = s.model.encode(prompts)
    b, n = ro.logp.shape
    out = torch.zeros(b, n)
    for i in torch.nonzero(s.trained, as_tuple=True)[0].tolist():
        x = ro.states[:, i]
        v = s.model.velocity(x, s.sigmas[i].expand(b), cond[group])
        step = s.step_fn(
            v, x, s.sigmas[i].item(), s.sigmas[i + 1].item(), float(s.levels[i]), x_next=ro.states[:, i + 1]
        )
        out[:, i] = step.logp
    return out
