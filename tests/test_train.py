"""The training loop end to end on the built-in task (small settings)."""

import json

import pytest
import torch
from loop_probes import SMALL_RUN

from flowcredit.config import Config, from_dict
from flowcredit.errors import UserError
from flowcredit.presets import COMPARED_PRESETS, PRESETS, load_config
from flowcredit.rewards.guard import RewardError
from flowcredit.run.calibrate import ensure_psi
from flowcredit.run.session import build_session
from flowcredit.train import grpo_iteration, train
from flowcredit.validation import validate

SMALL = SMALL_RUN

KEYS = [
    "reward/mean",
    "loss/policy",
    "loss/kl",
    "stats/clipfrac",
    "stats/approx_kl",
    "adv/abs_mean",
    "nfe/rollout",
    "nfe/values",
    "nfe/train",
    "stats/first_ratio_maxdev",
]


def small_config(preset: str, run_dir, **extra) -> Config:
    cfg = from_dict({**SMALL, "run_dir": str(run_dir), **extra}, PRESETS[preset]())
    if preset == "stepwise_grpo":
        cfg.window_start = 1
    return validate(cfg)


@pytest.mark.parametrize("preset", [*COMPARED_PRESETS, "skill"])
def test_preset_trains_through_the_one_loop(preset, tmp_path):
    extra = {"calib_max_iters": 1, "calib_groups": 1} if preset == "dense_grpo" else {}
    cfg = small_config(preset, tmp_path / "run", beta=0.01, **extra)
    s = build_session(cfg, resume=False)
    ensure_psi(s)  # train() calibrates ψ here (dense_grpo)
    before = {k: v.clone() for k, v in s.policy.trainable_state().items()}
    metrics = [grpo_iteration(s, it) for it in range(2)]
    after = s.policy.trainable_state()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter moved"
    assert set(before) and all("lora_" in k for k in before)
    updated = [m for m in metrics if "stats/optimizer_steps" in m]
    assert updated, "no iteration had a group with non-zero advantages"
    for m in updated:
        assert all(k in m for k in KEYS), sorted(set(KEYS) - set(m))
        assert all(v == v for v in m.values()), m  # no NaN
        assert m["stats/first_ratio_maxdev"] == 0.0  # first ratio after sampling is exactly 1
    if preset == "dense_grpo":
        assert (tmp_path / "run" / "psi.json").exists() and s.psi is not None


def test_train_writes_artifacts_and_refuses_to_overwrite(tmp_path):
    cfg = small_config("flow_grpo", tmp_path / "run")
    summary = train(cfg)
    run = tmp_path / "run"
    for name in [
        "metrics.jsonl",
        "timings.jsonl",
        "config.json",
        "reward_curve.png",
        "grid_start_test.png",
        "grid_after_test.png",
        "summary.json",
        "final/model.safetensors",
        "final/trainable.safetensors",
        "checkpoint/state.json",
    ]:
        assert (run / name).exists(), name
    assert list((run / "tb").iterdir())
    assert summary["iterations"] == 2 and "before" in summary["test"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1, 2]
    with pytest.raises(UserError, match="resume"):
        train(cfg)


def test_final_model_reloads_as_the_policy(tmp_path):
    from flowcredit.models.tiny import TinyFlowModel

    cfg = small_config("flow_grpo", tmp_path / "run", iterations=1, lr=0.05)
    train(cfg)
    s_final = TinyFlowModel.load(tmp_path / "run" / "final")
    s = build_session(validate(from_dict({**vars(cfg), "run_dir": str(tmp_path / "r2")})), resume=False)
    s.policy.load_trainable_state(
        __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            str(tmp_path / "run" / "final" / "trainable.safetensors")
        )
    )
    x = torch.randn(2, *s.model.latent_shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        want = s.model.velocity(x, sigma, s.model.encode(["a red circle", "two blue squares"]))
        got = s_final.velocity(x, sigma, s_final.encode(["a red circle", "two blue squares"]))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_final_export_holds_the_ema_weights(tmp_path):
    """With ``ema_decay`` the final weights are the EMA (what the evaluations measured), not the last
    iterate; the checkpoint keeps both."""
    from safetensors.torch import load_file

    from flowcredit.run.checkpoint import load_checkpoint

    cfg = small_config("flow_grpo", tmp_path / "run", iterations=2, lr=0.05, ema_decay=0.5)
    train(cfg)
    final = load_file(str(tmp_path / "run" / "final" / "trainable.safetensors"))
    state = load_checkpoint(tmp_path / "run" / "checkpoint")
    fresh = build_session(validate(from_dict({**vars(cfg), "run_dir": str(tmp_path / "r2")})), resume=False)
    names = list(fresh.policy.trainable_state())  # parameter order, the EMA's (files sort their keys)
    shadow = dict(zip(names, [state["ema"][k] for k in sorted(state["ema"])]))
    assert sorted(final) == sorted(state["trainable"]) == sorted(shadow)
    for name, got in final.items():
        torch.testing.assert_close(got, shadow[name], rtol=0, atol=0)
    assert any(not torch.equal(final[n], state["trainable"][n]) for n in final)


def test_nan_reward_names_reward_and_prompt(tmp_path):
    cfg = small_config(
        "flow_grpo",
        tmp_path / "run",
        reward="reward_fixtures:nan_for_red",
        train_prompts="test",
        num_train_prompts=0,
    )
    s = build_session(cfg, resume=False)
    s.train_metas = [m for m in s.train_metas if "red" in m["prompt"]][:2]
    with pytest.raises(
        ValueError, match=r"reward 'reward_fixtures:nan_for_red' returned nan for prompt '.*red"
    ):
        grpo_iteration(s, 0)


def test_skip_bad_rewards_drops_and_counts_groups(tmp_path):
    cfg = small_config(
        "flow_grpo", tmp_path / "run", reward="reward_fixtures:nan_for_red", skip_bad_rewards=True
    )
    s = build_session(cfg, resume=False)
    red = [m for m in s.train_metas if "red" in m["prompt"]][:1]
    other = [m for m in s.train_metas if "red" not in m["prompt"]][:1]
    s.train_metas = red + other
    counts = [grpo_iteration(s, it)["stats/bad_reward_groups"] for it in range(3)]
    assert max(counts) >= 1


def test_raising_reward_is_named(tmp_path):
    cfg = small_config("flow_grpo", tmp_path / "run", reward="reward_fixtures:raises")
    s = build_session(cfg, resume=False)
    with pytest.raises(RewardError, match="reward 'reward_fixtures:raises' failed on prompts like"):
        grpo_iteration(s, 0)


@pytest.mark.parametrize(
    "overrides,field",
    [
        (["--lr", "fast"], "lr"),
        (["--learning_rate", "1e-3"], "learning_rate"),
        (["--sampler", "euler"], "sampler"),
        (["--sampler", "ode"], "sampler"),
        (["--credit", "ppo"], "credit"),
        (["--calibrate", "true"], "calibrate"),
        (["--sampler", "cps", "--window_start", "0", "--window_size", "10"], "window_size"),
        (["--sampler", "ddim_sde", "--window_start", "0"], "window_start"),
        (["--group_size", "1"], "group_size"),
        (["--train_params", "everything"], "train_params"),
        (["--shared_noise", "maybe"], "shared_noise"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        load_config("flow_grpo", None, overrides)


def test_yaml_config_and_unknown_key(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("lr: 0.0003\ngroup_size: 4\ncredit: dense\n")
    cfg = load_config("flow_grpo", str(good), ["--group_size", "6"])
    assert cfg.lr == 3e-4 and cfg.group_size == 6 and cfg.credit == "dense"
    bad = tmp_path / "bad.yaml"
    bad.write_text("grop_size: 4\n")
    with pytest.raises(ValueError, match="unknown config key 'grop_size'"):
        load_config("flow_grpo", str(bad))


def test_a_non_shapeeval_reward_logs_plain_json_and_names_its_score(tmp_path, capsys):
    """Only ShapeEval has a pass/fail: no NaN ``strict`` in metrics.jsonl (NaN is not JSON), and the
    summary names the reward it averaged instead of "soft"."""
    train(small_config("flow_grpo", tmp_path / "run", reward="jpeg_compressibility", iterations=1))

    def refuse(constant):
        raise AssertionError(f"metrics.jsonl holds {constant}, which is not JSON")

    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert "eval/test/soft" in rows[0] and "eval/test/strict" not in rows[0]
    assert "(mean jpeg_compressibility, ODE" in capsys.readouterr().out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_no_preset_caps_by_minutes_or_depends_on_the_cpu(preset):
    """A preset's result depends on its seed and settings: no wall-clock cap, and float32 numerics on
    every CPU (bf16 autocast is the user's explicit speed option)."""
    cfg = PRESETS[preset]()
    assert cfg.max_minutes == 0 and cfg.autocast is False


def test_a_minutes_cap_says_the_run_stopped_early(tmp_path, capsys):
    cfg = small_config("flow_grpo", tmp_path / "run", iterations=3, max_minutes=1e-9)
    summary = train(cfg)
    assert summary["iterations"] == 1 and summary["stopped_early"] == {
        "by": "max_minutes=1e-09",
        "iterations": 3,
    }
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_early"]["iterations"] == 3
    assert "stopped early by max_minutes=1e-09 after 1 of 3 iterations" in capsys.readouterr().out
