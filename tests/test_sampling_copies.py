"""The rollout's LoRA copies (``sampling_copies`` in flowcredit/run/lora_compose.py, ``lora_forward``
'peft+copy', 'composed', 'auto'): inside, each LoRA layer runs one op with a copy of ``W + s·B·A``
computed once; the copy is the composed forward's own weight (a composed run samples the same
numbers), close to peft's forward, never under gradient; the base weights stay bit-identical over
iterations in float32 and bfloat16, on the built-in model and on a diffusers adapter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loop_probes import small_model
from test_lora_compose import _lora_net

import flowcredit.run.session as session_module
from flowcredit.config import Config
from flowcredit.presets import PRESETS
from flowcredit.run.lora_compose import (
    compose_lora,
    composed_forward,
    lora_forwards,
    lora_layers,
    sampling_copies,
)
from flowcredit.validation import validate


def test_a_copy_is_the_composed_forward_bit_for_bit_and_peft_to_round_off():
    x = torch.randn(4, 3, 4, 4)
    peft_net, comp_net = _lora_net(), _lora_net()
    compose_lora(comp_net)
    base = {n: p.clone() for n, p in peft_net.named_parameters()}
    with torch.no_grad():
        want_peft, want_comp = peft_net(x), comp_net(x)
        with sampling_copies(peft_net) as n_peft, sampling_copies(comp_net) as n_comp:
            got_peft, got_comp = peft_net(x), comp_net(x)
    assert n_peft == n_comp == 3
    assert torch.equal(got_comp, want_comp)  # the composed forward's own weight
    torch.testing.assert_close(got_peft, want_peft, rtol=1e-5, atol=1e-6)
    for name, p in peft_net.named_parameters():  # nothing written: A, B and W as they were
        assert torch.equal(p, base[name]), name
    for _, layer in lora_layers(peft_net):  # peft's own forward again, the copy freed
        assert "forward" not in vars(layer) and not hasattr(layer, "_sampling_weight")
    for _, layer in lora_layers(comp_net):  # the composed forward again
        assert vars(layer)["forward"].__func__ is composed_forward


def test_a_copy_follows_the_weights_of_its_entry():
    """Computed on entry: a LoRA moved between two rollouts is seen by the second one."""
    net, x = _lora_net(), torch.randn(2, 3, 4, 4)
    with torch.no_grad(), sampling_copies(net):
        first = net(x)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.mul_(2.0)
        want = net(x)
        with sampling_copies(net):
            second = net(x)
    assert not torch.allclose(first, second)
    torch.testing.assert_close(second, want, rtol=1e-5, atol=1e-6)


def test_a_copy_refuses_gradient():
    net = _lora_net()
    with sampling_copies(net), pytest.raises(RuntimeError, match="sampling"):
        net(torch.randn(1, 3, 4, 4))


def test_a_disabled_layer_runs_its_base_and_is_not_copied():
    net, x = _lora_net(), torch.randn(2, 3, 4, 4)
    layers = [m for _, m in lora_layers(net)]
    layers[0].enable_adapters(False)
    with torch.no_grad(), sampling_copies(net) as n:
        got = net(x)
        assert n == 2 and "forward" not in vars(layers[0])
    with torch.no_grad():
        torch.testing.assert_close(got, net(x), rtol=1e-5, atol=1e-6)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    ("fields", "compose_lora_attr", "dtype", "sharded", "want"),
    [
        ({"lora_forward": "peft"}, True, F32, False, (False, False)),
        ({"lora_forward": "composed"}, False, F32, False, (True, True)),
        ({"lora_forward": "peft+copy"}, True, F32, False, (False, True)),
        ({"lora_forward": "peft+copy"}, False, BF16, False, (False, True)),  # asked for
        ({"lora_forward": "auto"}, True, F32, False, (True, True)),  # the built-in model
        ({"lora_forward": "auto", "autocast": True}, True, F32, False, (True, True)),  # its own weight
        ({"lora_forward": "auto"}, False, F32, False, (False, True)),  # a float32 diffusers adapter
        ({"lora_forward": "auto"}, False, BF16, False, (False, False)),  # 16 bits: peft's forward
        ({"lora_forward": "auto", "autocast": True}, False, F32, False, (False, False)),
        ({"lora_forward": "auto"}, False, F32, True, (False, False)),  # FSDP shards: peft's forward
        ({"lora_forward": "auto", "train_params": "text"}, True, F32, False, (False, False)),
    ],
)
def test_which_runs_copy(fields, compose_lora_attr, dtype, sharded, want):
    model = type("Adapter", (), {"compose_lora": compose_lora_attr, "dtype": dtype})()
    assert lora_forwards(Config(**fields), model, sharded) == want


def _diffusers_config(tmp_path, dtype: str) -> Config:
    pytest.importorskip("diffusers", reason="needs the 'diffusers' extra")
    from tiny_diffusers import build_sd3, train_config

    (tmp_path / "prompts.txt").write_text("a red square\na photo of a cat\n")
    cfg = train_config(
        "flow_grpo", "sd3", build_sd3(tmp_path / "sd3"), tmp_path / "prompts.txt", tmp_path / "run"
    )
    return dataclasses.replace(cfg, dtype=dtype, reward="reward_fixtures:brightness")


def _builtin_config(tmp_path, dtype: str) -> Config:
    small = dict(
        num_train_prompts=2, eval_every=0, eval_samples_per_prompt=1, num_eval_prompts=1, num_steps=4
    )
    small |= dict(group_size=2, prompts_per_iter=2, batch_size=4, window_size=0, beta=0.01, log_with="none")
    small |= dict(reward="reward_fixtures:brightness")
    # a small random tiny model: the claim does not depend on the weights, and bf16 autocast on a CPU
    # without bf16 instructions (Zen 3) took 88 s with the built-in one
    small |= dict(checkpoint=small_model(tmp_path / "tiny16"))
    return dataclasses.replace(
        PRESETS["flow_grpo"](), **small, autocast=dtype == "bfloat16", run_dir=str(tmp_path / "run")
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["tiny", "sd3"])
def test_base_weights_stay_bit_identical_over_iterations(kind, dtype, tmp_path, monkeypatch, one_thread):
    """Three iterations with the rollout on copies (``lora_forward`` 'auto' on the built-in model,
    'peft+copy' on SD3, which 'auto' gives in float32 only), the values and evaluation on merged
    weights restored from a copy, the update through LoRA: every base weight of the network bit for
    bit what was loaded, in float32 and bfloat16 (the tiny model, small and random: bf16 autocast),
    and the LoRA moved."""
    from flowcredit.models import load_model
    from flowcredit.train import train

    make = _builtin_config if kind == "tiny" else _diffusers_config
    forward = "auto" if kind == "tiny" else "peft+copy"
    cfg = validate(dataclasses.replace(make(tmp_path, dtype), iterations=3, threads=1, lora_forward=forward))
    entered = []
    real = session_module.sampling_copies

    def counted(net):
        entered.append(net)
        return real(net)

    monkeypatch.setattr(session_module, "sampling_copies", counted)
    model = load_model(cfg)
    base = {k: v.clone() for k, v in model.net.state_dict().items()}
    train(cfg, model=model)
    after = {k.replace(".base_layer.", "."): v for k, v in model.net.state_dict().items() if "lora_" not in k}
    assert after.keys() == base.keys()
    changed = [k for k in base if not torch.equal(after[k], base[k])]
    assert not changed, f"base weights changed: {changed[:3]}"
    assert len(entered) == 3  # one rollout per iteration ran on copies
    lora = {k: v for k, v in model.net.state_dict().items() if "lora_B" in k}
    assert any(v.abs().max() > 0 for v in lora.values()), "the LoRA did not move"
