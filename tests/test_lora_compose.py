"""The composed LoRA forward (flowcredit/run/lora_compose.py) against peft's, layer by layer and
through the whole policy; and which runs compose."""

import pytest
import torch
from torch import nn

from flowcredit.config import Config
from flowcredit.errors import ConfigError
from flowcredit.run.lora_compose import compose_lora, composed_weight, lora_composed


def test_composed_weight_by_hand():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])  # (out 3, in 2)
    a = torch.tensor([[1.0, -1.0]])  # (r 1, in 2)
    b = torch.tensor([[2.0], [0.0], [1.0]])  # (out 3, r 1)
    want = torch.tensor([[1.0 + 1.0, 2.0 - 1.0], [3.0, 4.0], [5.0 + 0.5, 6.0 - 0.5]])  # W + 0.5·B·A
    assert torch.equal(composed_weight(w, a, b, 0.5), want)


def _lora_net(seed=0):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.SiLU(), nn.Conv2d(8, 4, 1), nn.Flatten(), nn.Linear(64, 5)
    )
    net = inject_adapter_in_model(LoraConfig(r=2, lora_alpha=3, target_modules=["0", "2", "4"]), net)
    for name, p in net.named_parameters():
        if "lora_B" in name:  # peft starts B at 0: make the LoRA matter
            nn.init.normal_(p, std=0.3)
    return net


def test_composed_equals_peft_values_and_gradients():
    x = torch.randn(5, 3, 4, 4)
    peft_net, comp_net = _lora_net(), _lora_net()
    assert compose_lora(comp_net) == 3
    outs, grads = [], []
    for net in (peft_net, comp_net):
        y = net(x)
        (y**2).sum().backward()
        outs.append(y)
        grads.append({n: p.grad for n, p in net.named_parameters() if "lora_" in n})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 6
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5)


def test_disabled_and_merged_layers_run_their_base():
    from peft.tuners.lora import LoraLayer

    net = _lora_net()
    compose_lora(net)
    x = torch.randn(2, 3, 4, 4)
    layers = [m for m in net.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        m.enable_adapters(False)
    plain = nn.Sequential(*(getattr(m, "base_layer", m) for m in net))
    torch.testing.assert_close(net(x), plain(x))
    for m in layers:
        m.enable_adapters(True)
    live = net(x)
    with torch.no_grad():
        for m in layers:
            m.merge()
    torch.testing.assert_close(net(x), live, rtol=1e-5, atol=1e-6)


def test_dropout_is_refused_by_name():
    from peft import LoraConfig, inject_adapter_in_model

    net = inject_adapter_in_model(
        LoraConfig(r=2, target_modules=["0"], lora_dropout=0.1), nn.Sequential(nn.Linear(4, 4))
    )
    with pytest.raises(ValueError, match="'0'"):
        compose_lora(net)


class _Tiny:
    compose_lora = True


@pytest.mark.parametrize(
    "fields, model, sharded, want",
    [
        ({}, _Tiny(), False, True),  # auto on the built-in model
        ({}, object(), False, False),  # auto on an adapter that does not ask
        ({"lora_forward": "composed"}, object(), False, True),
        ({"lora_forward": "peft"}, _Tiny(), False, False),
        ({}, _Tiny(), True, False),  # FSDP shards: never
        ({"train_params": "all"}, _Tiny(), False, False),
    ],
)
def test_which_runs_compose(fields, model, sharded, want):
    assert lora_composed(Config(**fields), model, sharded) is want


def test_composed_on_shards_is_a_config_error():
    with pytest.raises(ConfigError, match="lora_forward"):
        lora_composed(Config(lora_forward="composed"), object(), True)


@pytest.mark.parametrize("forward", ["auto", "peft"])
def test_a_run_composes_and_its_first_ratio_is_one(tmp_path, one_thread, forward):
    """The rollout and the update run the same forward: the first update sees r == 1 exactly."""
    from loop_probes import small_session
    from peft.tuners.lora import LoraLayer

    from flowcredit.train import grpo_iteration

    s = small_session("flow_grpo", tmp_path, lora_forward=forward)
    layers = [m for m in s.model.net.modules() if isinstance(m, LoraLayer)]
    composed = ["forward" in vars(m) for m in layers]  # the composed forward is bound per layer
    assert layers and all(c == (forward == "auto") for c in composed)
    assert grpo_iteration(s, 0)["stats/first_ratio_maxdev"] == 0.0
