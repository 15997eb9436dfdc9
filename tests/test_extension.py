"""Extending flowcredit from outside the package: a credit method, a sampler and a model adapter are
each one function plus one registration call; nothing in ``flowcredit/`` is edited."""

from __future__ import annotations

import json

import pytest
import torch

from flowcredit import advantages, sde
from flowcredit.advantages import group_zscore, register_credit
from flowcredit.config import from_dict
from flowcredit.errors import ConfigError
from flowcredit.models import FlowModelBase, load_builtin
from flowcredit.presets import load_config
from flowcredit.sde import Sampler, register_sampler
from flowcredit.train import train
from flowcredit.validation import validate

SMALL = dict(
    iterations=2,
    prompts_per_iter=2,
    group_size=4,
    num_train_prompts=4,
    num_eval_prompts=2,
    eval_samples_per_prompt=2,
    eval_every=0,
    num_steps=4,
    window_size=0,
    batch_size=8,
)


def tempered_terminal(values, group, trained, *, eps, adv_clip, temperature=1.0):
    """A toy method: Flow-GRPO's z-scored terminal reward divided by ``temperature``."""
    final = values[:, -1:]  # (B, 1)
    z = group_zscore(final, group, torch.ones_like(final, dtype=torch.bool), eps) / temperature
    return z.clamp(-adv_clip, adv_clip) * trained.view(1, -1)  # (B, N)


@pytest.fixture
def toy_credit():
    calls = []

    def fn(values, group, trained, *, eps, adv_clip, temperature=1.0):
        calls.append(temperature)
        return tempered_terminal(values, group, trained, eps=eps, adv_clip=adv_clip, temperature=temperature)

    register_credit("tempered", fn, needs="final", options={"temperature": 1.0})
    yield calls
    advantages.CREDITS.pop("tempered")
    advantages.ADVANTAGES.pop("tempered")


def test_toy_credit_method_trains_with_its_own_option(toy_credit, tmp_path):
    overrides = [
        "--credit",
        "tempered",
        "--credit_options",
        '{"temperature": 2.0}',
        "--run_dir",
        str(tmp_path),
    ]
    cfg = from_dict(SMALL, load_config("flow_grpo", None, overrides))
    summary = train(validate(cfg))
    assert summary["iterations"] == 2
    assert toy_credit == [2.0, 2.0]  # the option reached the function, once per iteration
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[1]["nfe/values"] == 0  # needs="final": no completions were run


def test_misspelt_option_of_a_registered_method_is_named(toy_credit):
    with pytest.raises(
        ConfigError, match="credit_options.*'tempered' has no option 'temprature'.*temperature"
    ):
        load_config("flow_grpo", None, ["--credit", "tempered", "--credit_options", '{"temprature": 2}'])
    with pytest.raises(ConfigError, match="option 'temperature' of 'tempered' must be float"):
        load_config("flow_grpo", None, ["--credit", "tempered", "--credit_options", '{"temperature": "hot"}'])


def test_built_in_options_keep_their_own_fields():
    with pytest.raises(ConfigError, match="own field --tp_balance"):
        load_config("tp_grpo", None, ["--credit_options", '{"balance": "none"}'])
    with pytest.raises(ConfigError, match="'dense' has no option 'balance'"):
        load_config("dense_grpo", None, ["--credit_options", '{"balance": "none"}'])


def test_registration_checks_the_function():
    with pytest.raises(ValueError, match="takes no keyword 'temperature'"):
        register_credit(
            "broken", lambda values, group, trained, *, eps, adv_clip: values, "final", {"temperature": 1}
        )
    with pytest.raises(ValueError, match="needs must be one of"):
        register_credit("broken", tempered_terminal, "everything")
    with pytest.raises(ValueError, match="already registered"):
        register_credit("dense", tempered_terminal, "states")
    assert "broken" not in advantages.CREDITS


def test_sampler_constraints_come_from_its_entry():
    register_sampler("toy_sde", Sampler(sde.cps_step, 0.5, last_step_deterministic=True, max_level=0.6))
    try:
        base = ["--sampler", "toy_sde", "--window_start", "0"]
        with pytest.raises(ConfigError, match="window_size.*last step of toy_sde"):
            load_config("flow_grpo", None, [*base, "--window_size", "10", "--noise_level", "0.5"])
        with pytest.raises(ConfigError, match="noise_level.*toy_sde needs level <= 0.6"):
            load_config("flow_grpo", None, [*base, "--window_size", "3", "--noise_level", "0.9"])
        assert load_config("flow_grpo", None, [*base, "--window_size", "3", "--noise_level", "0.5"])
    finally:
        for registry in (sde.SAMPLER_ENTRIES, sde.SAMPLERS, sde.DEFAULT_LEVELS):
            registry.pop("toy_sde")


class WrappedTiny(FlowModelBase):
    """An adapter defined outside the package: the built-in network behind the contract's members."""

    def __init__(self):
        self.inner = load_builtin()
        self.net, self.latent_shape = self.inner.net, self.inner.latent_shape
        self.guidance_scale = self.inner.guidance_scale
        self.default_lora_targets = "unet"

    def encode(self, prompts):
        return self.inner.encode(prompts)

    def velocity(self, x, sigma, cond):
        return self.inner.velocity(x, sigma, cond)

    def decode(self, x):
        return self.inner.decode(x)


def load_wrapped(cfg):
    return WrappedTiny()


def test_adapter_by_import_path_trains(tmp_path):
    cfg = from_dict({**SMALL, "iterations": 1}, load_config("flow_grpo", None, ["--run_dir", str(tmp_path)]))
    cfg.model = "test_extension:load_wrapped"
    summary = train(validate(cfg))
    assert summary["iterations"] == 1 and (tmp_path / "final" / "trainable.safetensors").is_file()


def test_adapter_missing_members_is_named(tmp_path):
    class Half:
        latent_shape, guidance_scale = (3, 8, 8), 1.0

    from flowcredit.run.session import build_session

    cfg = from_dict(SMALL, load_config("flow_grpo", None, ["--run_dir", str(tmp_path)]))
    with pytest.raises(TypeError, match="lacks net, encode, velocity, decode, num_steps"):
        build_session(cfg, model=Half())


def test_the_command_line_imports_a_plugin_method(tmp_path, capsys):
    from flowcredit import cli

    small = [s for k, v in {**SMALL, "iterations": 1}.items() for s in (f"--{k}", str(v))]
    argv = ["train", "--imports", "toy_credit_plugin", "--credit", "halved_terminal"]
    argv += ["--credit_options", '{"scale": 0.25}', "--run_dir", str(tmp_path / "run"), *small]
    assert cli.main(argv) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["iterations"] == 1
    capsys.readouterr()
    assert cli.main([*argv[:5], "--credit_options", '{"scael": 1}', "--run_dir", str(tmp_path / "r2")]) == 2
    assert "'halved_terminal' has no option 'scael' (options: scale)" in capsys.readouterr().err
    assert cli.main(["train", "--imports", "no_such_plugin"]) == 2
    assert "config field 'imports': cannot import 'no_such_plugin'" in capsys.readouterr().err
