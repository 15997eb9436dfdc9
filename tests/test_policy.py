"""Trainable sets, LoRA, the reference policy and EMA on the built-in model."""

import pytest
import torch

from flowcredit.models.tiny import load_builtin
from flowcredit.run.policy import EMA, Policy, lora_target_names

PROMPTS = ["a red circle", "three blue squares"]


def _velocity(model):
    x = torch.randn(2, *model.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.velocity(x, torch.tensor([0.8, 0.3]), model.encode(PROMPTS))


def _perturb(params):
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("train_params", ["lora", "text", "lora+text", "all"])
def test_reference_is_the_initial_policy(train_params):
    model = load_builtin()
    base = _velocity(model)
    policy = Policy(model, train_params, lora_rank=2, lora_alpha=2.0, need_reference=True, seed=0)
    torch.testing.assert_close(_velocity(model), base)  # LoRA starts at B = 0
    names = {n for n, p in model.net.named_parameters() if p.requires_grad}
    if train_params == "lora":
        assert names and all("lora_" in n for n in names)
    if train_params == "text":
        assert names and all(n.startswith("text.") for n in names)
    if train_params == "all":
        assert len(names) == sum(1 for _ in model.net.parameters())
    _perturb(policy.parameters())
    assert not torch.allclose(_velocity(model), base)
    with policy.reference():
        torch.testing.assert_close(_velocity(model), base)
    assert not torch.allclose(_velocity(model), base)  # the policy is back after the context


@pytest.mark.parametrize("targets", ["unet", "unet,text"])
def test_merged_weights_reproduce_the_lora_policy(targets):
    model = load_builtin()
    base = _velocity(model)
    policy = Policy(
        model, "lora", lora_rank=2, lora_alpha=4.0, lora_targets=targets, need_reference=True, seed=0
    )
    _perturb(policy.parameters())
    with policy.reference():  # LoRA off everywhere, the text encoder's included
        torch.testing.assert_close(_velocity(model), base)
    merged = type(model)(model.config)
    merged.net.load_state_dict(policy.merged_state_dict())
    merged.guidance_scale = model.guidance_scale
    torch.testing.assert_close(_velocity(merged), _velocity(model), rtol=1e-3, atol=1e-4)


def test_merged_context_runs_the_policy_and_restores_weights_exactly():
    model = load_builtin()
    policy = Policy(model, "lora", lora_rank=2, lora_alpha=4.0, seed=0)
    _perturb(policy.parameters())
    before = {n: t.clone() for n, t in model.net.state_dict().items()}
    unmerged = _velocity(model)
    with policy.merged():
        merged = _velocity(model)
        changed = [n for n, t in model.net.state_dict().items() if not torch.equal(t, before[n])]
    assert changed and all(n.endswith("base_layer.weight") for n in changed)  # LoRA folded into the base
    torch.testing.assert_close(merged, unmerged, rtol=1e-3, atol=1e-4)
    after = model.net.state_dict()
    assert all(torch.equal(after[n], before[n]) for n in before)  # bit-exact, not merely unmerged
    assert torch.equal(_velocity(model), unmerged)


def test_lora_targets_errors_and_text_needs_text_module():
    model = load_builtin()
    with pytest.raises(ValueError, match="lora_targets"):
        lora_target_names(model.net, "no_such_layer")
    assert "unet.mid_attn.attn.q" in lora_target_names(model.net, "q,k")


def test_lora_targets_name_top_level_modules():
    model = load_builtin()
    layers = [n for n, m in model.net.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    unet = [n for n in layers if n.split(".")[0] == "unet"]
    text = [n for n in layers if n.split(".")[0] == "text"]
    assert unet and text
    assert lora_target_names(model.net, "unet") == unet
    assert lora_target_names(model.net, "text") == text
    assert sorted(lora_target_names(model.net, "unet, text")) == sorted(unet + text)
    both = lora_target_names(model.net, "text,q")  # a module and a suffix together
    assert set(text) < set(both) and "unet.mid_attn.attn.q" in both
    # a top-level child that is itself a layer is selected by its name, and only it
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert lora_target_names(seq, "0") == ["0"]


def test_ema_tracks_and_applies():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([p], decay=0.75)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 0.25))  # 0.75·0 + 0.25·1
    with ema.applied():
        torch.testing.assert_close(p.detach(), torch.full((3,), 0.25))
    torch.testing.assert_close(p.detach(), torch.ones(3))


def _guided_by_hand(model, x, sigma, cond, detach_null: bool) -> torch.Tensor:
    """The tiny model's CFG velocity built from its unguided passes, ``v_null`` detached on request."""
    from flowcredit.models.tiny import TextCond

    null = cond.null.expand(len(x))
    if detach_null:  # the unconditional rows as a pass of their own, without a graph
        with torch.no_grad():
            v_null = model.predict(x, sigma, null)
        v_cond = model.predict(x, sigma, cond)
    else:  # both branches as one batch of 2B rows
        both = TextCond.cat([cond, null])
        v_cond, v_null = model.predict(torch.cat([x, x]), torch.cat([sigma, sigma]), both).chunk(2)
    return v_null + model.guidance_scale * (v_cond - v_null)


@pytest.mark.parametrize("through_uncond", [True, False])
def test_cfg_uncond_grad_detaches_the_unconditional_branch(through_uncond):
    """``cfg_uncond_grad`` false (Flow-GRPO's ``noise_pred_uncond.detach()``): the LoRA gradient equals
    the hand-built one with ``v_null`` detached, and nothing flows into the null branch's inputs; true
    (the default): the gradient of both branches. The forward values are the same either way."""
    from flowcredit.models.tiny import TextCond

    model = load_builtin()
    policy = Policy(model, "lora", lora_rank=2, lora_alpha=2.0, seed=0)
    _perturb(policy.parameters())
    model.cfg_uncond_grad = through_uncond
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, *model.latent_shape, generator=gen)
    sigma, weights = torch.tensor([0.8, 0.3]), torch.randn(2, *model.latent_shape, generator=gen)
    with torch.no_grad():
        encoded = model.encode(PROMPTS)
    null = TextCond(encoded.null.tokens.clone().requires_grad_(), encoded.null.mask, encoded.null.pooled)
    cond = TextCond(encoded.tokens, encoded.mask, encoded.pooled, null)

    def lora_grads(velocity) -> list[torch.Tensor]:
        for p in policy.parameters():
            p.grad = None
        (velocity() * weights).sum().backward()
        return [p.grad.clone() for p in policy.parameters()]

    got = lora_grads(lambda: model.velocity(x, sigma, cond))
    null_grad, null.tokens.grad = null.tokens.grad, None
    same = lora_grads(lambda: _guided_by_hand(model, x, sigma, cond, detach_null=not through_uncond))
    other = lora_grads(lambda: _guided_by_hand(model, x, sigma, cond, detach_null=through_uncond))
    for a, b in zip(got, same):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert max((a - b).abs().max().item() for a, b in zip(got, other)) > 1e-4
    if through_uncond:
        assert null_grad is not None and null_grad.abs().max() > 0
    else:
        assert null_grad is None or not null_grad.any()  # the unconditional branch: zero gradient
    with torch.no_grad():  # without gradient, CFG's one joint pass whatever cfg_uncond_grad says
        torch.testing.assert_close(
            model.velocity(x, sigma, cond), _guided_by_hand(model, x, sigma, cond, False)
        )


def test_cfg_uncond_grad_reaches_the_adapter_and_needs_a_switch(tmp_path):
    """The config field sets the adapter's switch in the session; an adapter without one refuses
    ``false`` (it would train through both branches unnoticed)."""
    from types import SimpleNamespace

    from test_train import small_config

    from flowcredit.errors import ConfigError
    from flowcredit.run.session import build_session, set_cfg_uncond_grad

    s = build_session(small_config("flow_grpo", tmp_path / "run", cfg_uncond_grad=False))
    assert s.model.cfg_uncond_grad is False
    assert load_builtin().cfg_uncond_grad is True  # the default: today's gradient through both
    set_cfg_uncond_grad(True, SimpleNamespace())  # true asks nothing of an adapter
    with pytest.raises(ConfigError, match="cfg_uncond_grad"):
        set_cfg_uncond_grad(False, SimpleNamespace())


def test_the_tiny_model_has_no_text_length_to_set():
    from flowcredit.config import Config
    from flowcredit.errors import ConfigError
    from flowcredit.models import load_model

    assert load_model(Config()).guidance_scale > 0  # 0 (the default) asks nothing
    with pytest.raises(ConfigError, match="max_sequence_length.*no text length"):
        load_model(Config(max_sequence_length=8))
