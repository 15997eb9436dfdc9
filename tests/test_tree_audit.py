"""The credit audit of a tree rollout (flowcredit/run/tree_audit.py): distinct states completed once,
each edge counted once, the tree rules' credit as the loop computes it, and the command on a tree plan."""

from __future__ import annotations

import json

import pytest
import torch

from flowcredit.credit_audit import group_step_sign_agreement, group_step_spearman
from flowcredit.run.tree_audit import TREE_RULES, unique_rows

TREE = ["--group_size", "4", "--step_schedule_options", '{"fanout": 2, "depth": 2}', "--num_steps", "6"]


def test_unique_rows_in_order_of_appearance():
    x = torch.tensor([[2.0, 1.0], [0.0, 0.0], [2.0, 1.0], [5.0, 5.0], [0.0, 0.0]])
    first, inverse = unique_rows(x)
    assert first.tolist() == [0, 1, 3] and inverse.tolist() == [0, 1, 0, 2, 1]


def test_owned_members_only_by_hand():
    """Step 0: rows 0 and 2 own it (row 1 repeats row 0's edge): ρ over (1, 3) vs (2, 1) = −1; step 1:
    all three, credit ranks (0, 1, 2) against Δ (1, 3, −2)'s (1, 2, 0): ρ = −0.5; sign agreement 2 of 3."""
    credit = torch.tensor([[1.0, 1.0], [1.0, 2.0], [3.0, 3.0]])
    delta = torch.tensor([[2.0, 1.0], [9.0, 3.0], [1.0, -2.0]])
    owned = torch.tensor([[True, True], [False, True], [True, True]])
    group, trained = torch.zeros(3, dtype=torch.long), torch.tensor([True, True])
    rho = group_step_spearman(credit, delta, group, trained, owned=owned)
    assert rho.tolist() == [[pytest.approx(-1.0), pytest.approx(-0.5)]]
    sign = group_step_sign_agreement(credit, delta, group, trained, owned=owned)
    assert sign.tolist() == [[1.0, pytest.approx(2 / 3)]]


def test_a_tree_is_audited_edge_by_edge(tmp_path, monkeypatch):
    """A TreeGRPO tree of 2 × 2 leaves: a state shared by leaves is completed once (the network rows
    counted), shared states hold one value, each rule's credit is the loop's (``Sampled.shape_credit``
    for TreeGRPO's own shape), and the owned mask counts each edge once."""
    from loop_probes import small_model

    from flowcredit.models import load_model
    from flowcredit.presets import load_config
    from flowcredit.run import plans
    from flowcredit.run.audit import summarise
    from flowcredit.run.session import build_reward
    from flowcredit.run.tree_audit import tree_audit_group
    from flowcredit.tasks.shapes import load_prompts

    argv = [*TREE, "--checkpoint", small_model(tmp_path / "m"), "--reward", "reward_fixtures:brightness"]
    cfg = load_config("tree_grpo", None, argv)
    model, reward = load_model(cfg), build_reward(cfg, cfg.reward)
    seen = {}
    sample = plans.tree_sample
    monkeypatch.setattr(plans, "tree_sample", lambda *a, **k: seen.setdefault("s", sample(*a, **k)))
    a = tree_audit_group(model, cfg, reward, load_prompts("test")[:1], m=3, seed=0, index=0)
    s, sde = seen["s"], a.trained
    steps = torch.nonzero(sde, as_tuple=True)[0].tolist()
    assert len(steps) == 2 and a.completions.shape == (4, 7, 3)
    first, second = steps  # the root's split, then the two depth-1 nodes'
    assert torch.equal(a.completions[0, first], a.completions[3, first])  # one root
    assert torch.equal(a.completions[0, second], a.completions[1, second])  # node 0's two children
    assert not torch.equal(a.completions[0, second], a.completions[2, second])
    # each distinct end of a trained transition completed once: the root (at `first`), the 2 depth-1
    # nodes (at `second`); the leaves' states after the last split need none (ODE to the end)
    assert a.mc_nfe * 4 == 3 * (1 * (6 - first) + 2 * (6 - second))
    assert first == 0 or torch.isnan(a.completions[:, first - 1]).all()  # the trunk before the root
    assert a.owned[:, first].tolist() == [True, False, True, False]  # the root's 2 edges
    assert a.owned[:, second].tolist() == [True, True, True, True]  # the 4 edges into the leaves
    leaf = a.credit["flow_grpo"]
    assert torch.allclose(a.credit["treegrpo"], s.tree_credit(leaf) * sde, atol=1e-6)
    assert set(a.credit) == set(TREE_RULES) and all(v == 0 for v in a.nfe.values())
    report = summarise([a, a])
    assert set(report["rules"]) == set(TREE_RULES) and len(report["steps"]) == 2


def test_the_audit_command_on_a_tree_plan(tmp_path):
    from loop_probes import small_model

    from flowcredit.commands.audit import main
    from flowcredit.errors import ConfigError

    argv = ["--preset", "tree_grpo", *TREE, "--checkpoint", small_model(tmp_path / "m")]
    argv += [
        "--reward",
        "reward_fixtures:brightness",
        "--max-prompts",
        "2",
        "--m",
        "3",
        "--out",
        str(tmp_path / "a"),
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "a" / "audit.json").read_text())
    assert set(report["rules"]) == set(TREE_RULES) and report["settings"]["tree"] == "treegrpo"
    assert report["gradient_cosine"] == {}
    assert main(argv) == 0  # read back from groups/ (the owned masks stored)
    assert json.loads((tmp_path / "a" / "audit.json").read_text())["rules"] == report["rules"]
    with pytest.raises(ConfigError, match="rules"):
        main([*argv, "--rules", "flow_grpo"])
