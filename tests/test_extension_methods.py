"""Extending flowcredit from outside the package, the newer methods' way: a step schedule, a per-step
loss weight and an update rule are each one function plus one registration call, chosen by name in
the config with their own options; nothing in ``flowcredit/`` is edited."""

from __future__ import annotations

import json

import pytest
import torch

from flowcredit import step_schedules, step_weights, updates
from flowcredit.errors import ConfigError
from flowcredit.losses import clipped_surrogate
from flowcredit.presets import load_config
from flowcredit.step_schedules import StepPlan, register_step_schedule
from flowcredit.step_weights import register_step_weight
from flowcredit.train import train
from flowcredit.updates import register_update

SMALL = [
    *("--iterations", "2", "--prompts_per_iter", "2", "--group_size", "4", "--num_train_prompts", "4"),
    *("--num_eval_prompts", "1", "--eval_samples_per_prompt", "1", "--eval_every", "0", "--num_steps", "4"),
    *("--batch_size", "8", "--log_with", "none", "--reward", "reward_fixtures:brightness"),
]


@pytest.fixture
def toys():
    """A schedule (SDE on every ``every``-th step from ``first``), a weight (``scale`` on the first trained
    step, 1 elsewhere) and an update (the clipped surrogate times ``factor``), each recording its calls."""
    calls = {"schedule": [], "weight": [], "update": []}

    def every_kth(sigmas, *, level, iteration, total, generator, every=2, first=0):
        calls["schedule"].append((iteration, every, first))
        n = sigmas.numel() - 1
        sde = torch.zeros(n, dtype=torch.bool)
        sde[first : n - 1 : every] = True
        return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1))

    def first_scaled(sigmas, trained, std=None, *, scale=2.0):
        calls["weight"].append(scale)
        w = trained.float()
        w[int(trained.nonzero()[0, 0])] *= scale
        return w

    def scaled_clip(logp_new, logp_old, adv, *, factor=1.0):
        calls["update"].append((factor, len(adv)))
        return factor * clipped_surrogate(logp_new, logp_old, adv, 1e-3)

    register_step_schedule("every_kth", every_kth)
    register_step_weight("first_scaled", first_scaled)
    register_update("scaled_clip", scaled_clip, ("logp",), {"factor": 1.0})
    yield calls
    step_schedules.STEP_SCHEDULES.pop("every_kth")
    step_weights.STEP_WEIGHTS.pop("first_scaled")
    updates.UPDATES.pop("scaled_clip")


def test_toy_schedule_weight_and_update_train_with_their_own_options(toys, tmp_path):
    """Chosen by name with JSON options: the loop plans with the toy schedule every iteration (its
    options reach it), weighs with the toy weight and computes the loss with the toy rule, on the
    schedule's trained steps only."""
    overrides = [
        *SMALL,
        *("--run_dir", str(tmp_path / "run"), "--step_schedule", "every_kth"),
        *("--step_schedule_options", json.dumps({"every": 2, "first": 1})),
        *("--step_weight", "first_scaled", "--step_weight_options", '{"scale": 3.0}'),
        *("--update", "scaled_clip", "--update_options", '{"factor": 0.5}'),
    ]
    train(load_config("flow_grpo", None, overrides))
    assert [c[0] for c in toys["schedule"]] == [0, 1] and {c[1:] for c in toys["schedule"]} == {(2, 1)}
    assert toys["weight"] == [3.0, 3.0]
    # steps 1 only (step 3 is the last of 4, excluded): one micro-batch of 8 rows per iteration
    assert toys["update"] == [(0.5, 8), (0.5, 8)]
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["nfe/train"] for m in metrics if "nfe/train" in m] == [8 * 2, 8 * 2]  # rows × CFG passes


@pytest.mark.parametrize(
    ("flag", "options", "culprit"),
    [
        ("--step_schedule_options", '{"every": 2, "stride": 1}', "step_schedule_options"),
        ("--step_weight_options", '{"scale": "big"}', "step_weight_options"),
        ("--update_options", '{"factor": true}', "update_options"),
        ("--update_options", "[1]", "update_options"),
    ],
)
def test_bad_options_name_their_field(toys, flag, options, culprit):
    """An unknown option, a wrong type or a non-object is a one-line ConfigError naming the field."""
    chosen = ["--step_schedule", "every_kth", "--step_weight", "first_scaled", "--update", "scaled_clip"]
    with pytest.raises(ConfigError) as err:
        load_config("flow_grpo", None, [*chosen, flag, options])
    assert err.value.field == culprit and "\n" not in str(err.value)
