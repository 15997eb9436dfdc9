"""Every random draw of an iteration changes with the iteration and comes back on resume (issue 54).

Generators are seeded from ``(seed, iteration, purpose)`` (``flowcredit.run.rollout.seeded``): the
prompts, the initial noise, the SDE noise and the order in which the update visits the trained steps.
Resume exactness (tests/test_resume.py) holds just as well if every iteration drew the same batch,
a run that trains on one batch forever; this test asks that two iterations of one run draw
differently, and that a run resumed from its checkpoint after iteration 0 draws iteration 1's again.
"""

from __future__ import annotations

import pytest
import torch
from loop_probes import small_config, small_model

import flowcredit.sde
import flowcredit.train as loop
from flowcredit.run.session import build_session


def iteration_draws(s, it: int, monkeypatch) -> dict:
    """Run the real ``grpo_iteration(s, it)`` and record what it drew: the prompts and initial noise
    of its batch, the noise handed to the sampler at every rollout step, and the order of the steps
    the update visits."""
    seen: dict = {"noise": [], "order": []}
    real_draw, real_loss = s.draw, loop.step_loss
    real_step = flowcredit.sde.SAMPLERS[s.cfg.sampler]

    def draw(iteration):
        batch = real_draw(iteration)
        seen.update(prompts=list(batch.prompts), x0=batch.x0.clone())
        return batch

    def step(*args, noise=None, **kwargs):
        if noise is not None:  # the rollout's steps (the update re-scores with x_next, no noise)
            seen["noise"].append(noise.clone())
        return real_step(*args, noise=noise, **kwargs)

    def step_loss(s_, plan, levels, sam, adv, prompts, cond, r, i, *rest):
        if not seen["order"] or seen["order"][-1] != i:  # one entry per step, not per row chunk
            seen["order"].append(i)
        return real_loss(s_, plan, levels, sam, adv, prompts, cond, r, i, *rest)

    with monkeypatch.context() as m:
        m.setattr(s, "draw", draw)
        m.setitem(flowcredit.sde.SAMPLERS, s.cfg.sampler, step)
        m.setattr(loop, "step_loss", step_loss)
        loop.grpo_iteration(s, it)
    seen["noise"] = torch.stack(seen["noise"])  # (N, B, C, H, W)
    return seen


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return small_model(tmp_path_factory.mktemp("model") / "tiny16")


def test_each_iteration_draws_its_own_and_a_resume_draws_them_again(tmp_path, model, monkeypatch):
    # flow_grpo at test size: 2 prompts drawn from 4 (with replacement) × 6 rows, 5 steps (4 SDE, all
    # trained), one update pass visiting the 4 steps in a random order
    cfg = small_config("flow_grpo", tmp_path / "run", checkpoint=model)
    s = build_session(cfg)
    first = iteration_draws(s, 0, monkeypatch)
    s.save(1)  # what train() writes after iteration 0
    second = iteration_draws(s, 1, monkeypatch)
    assert len(first["noise"]) == len(second["noise"]) == cfg.num_steps
    assert sorted(first["order"]) == sorted(second["order"]) == [0, 1, 2, 3]

    assert first["prompts"] != second["prompts"]
    assert not torch.equal(first["x0"], second["x0"])
    for i in range(cfg.num_steps):  # every step's SDE noise is new
        assert not torch.equal(first["noise"][i], second["noise"][i]), i
    assert first["order"] != second["order"]

    resumed = build_session(cfg, resume=True)
    assert resumed.start_iteration == 1
    again = iteration_draws(resumed, resumed.start_iteration, monkeypatch)
    assert again["prompts"] == second["prompts"] and again["order"] == second["order"]
    assert torch.equal(again["x0"], second["x0"]) and torch.equal(again["noise"], second["noise"])
