"""A trained diffusers run from the command line (issue 25): ``flowcredit sample/eval --checkpoint
RUN/final`` (and ``--config RUN/config.json``) load the run's base model plus its LoRA, and sample
exactly what the trained policy samples; model-load errors are one line with exit status 2 and leave
nothing behind; the smaller load-time checks."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

from tiny_diffusers import BUILDERS, SIZE, WAN_FRAMES, train_config  # noqa: E402

from flowcredit.cli import main as cli  # noqa: E402
from flowcredit.commands import eval as eval_cmd  # noqa: E402
from flowcredit.run.evaluation import initial_noise, sample  # noqa: E402
from flowcredit.run.session import build_session  # noqa: E402
from flowcredit.train import train  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
BUILD = BUILDERS
PROMPTS = ["a red square", "a photo of a cat"]


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipes_cli")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {kind: build(root / kind) for kind, build in BUILD.items()}, prompts


def trained_run(pipes, kind, run_dir):
    dirs, prompts = pipes
    cfg = train_config("flow_grpo", kind, dirs[kind], prompts, run_dir)
    cfg.lr, cfg.threads = 0.05, 1  # move the LoRA far enough to tell it from the base
    train(cfg)
    return cfg


def cli_args(**kw) -> argparse.Namespace:
    base = dict(
        config=None, model=None, checkpoint=None, resolution=None, frames=None, dtype=None, device=None
    )
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kind", BUILD)
def test_sample_from_a_runs_final_equals_the_trained_policy(pipes, kind, tmp_path):
    run = tmp_path / "run"
    cfg = trained_run(pipes, kind, run)
    policy = build_session(cfg, resume=True)  # the last iterate (no EMA here): what final/ exported
    noise = initial_noise(2, tuple(policy.model.latent_shape), 0)
    steps, shift, guidance = 3, cfg.shift, policy.model.guidance_scale
    want = sample(policy.model, PROMPTS, noise, steps, shift, guidance)
    with policy.policy.reference():
        base = sample(policy.model, PROMPTS, noise, steps, shift, guidance)
    assert (want - base).abs().max() > 1e-3  # the LoRA changed the samples

    for args in (cli_args(checkpoint=str(run / "final")), cli_args(config=str(run / "config.json"))):
        cli_cfg, final = eval_cmd.config_from_args(args)
        assert final == run / "final" and cli_cfg.checkpoint == cfg.checkpoint  # the base, plus final/
        got = sample(eval_cmd.load_for_cli(cli_cfg, final), PROMPTS, noise, steps, shift, guidance)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    out = tmp_path / "s.png"
    argv = ["sample", "--checkpoint", str(run / "final"), "--prompt", "a red square", "--n", "1"]
    assert cli([*argv, "--steps", "2", "--threads", "1", "--out", str(out)]) == 0 and out.stat().st_size
    info = json.loads((run / "final" / "flowcredit_export.json").read_text())
    assert info["pipeline"] == type(policy.model.pipe).__name__
    if kind == "wan":  # the policy's text context, for a plain pipe(prompt, max_sequence_length=…)
        assert info["max_sequence_length"] == policy.model.max_sequence_length


def _train_cli(run, *flags):
    return cli(["train", "--run_dir", str(run), "--iterations", "1", "--log_with", "none", *flags])


@pytest.mark.parametrize(
    ("kind", "flags", "needle"),
    [
        ("wan", ["--num_frames", "4", "--resolution", str(SIZE)], "config field 'num_frames': 4 must be"),
        ("wan", ["--num_frames", str(WAN_FRAMES), "--resolution", "33"], "config field 'resolution': 33×33"),
        ("sd3", ["--checkpoint", "/no/such/pipeline"], "config field 'checkpoint': no such directory"),
        ("wan", ["--checkpoint", "QWEN", "--resolution", str(SIZE)], "holds a QwenImagePipeline"),
        ("sd3", ["--checkpoint", "QWEN"], "use --model qwen_image"),
        ("sd3", ["--checkpoint", "ROOT"], "is not a diffusers pipeline (no model_index.json)"),
        (
            "wan",
            ["--num_frames", str(WAN_FRAMES), "--resolution", str(SIZE), "--reward_frame_stride", "5"],
            "config field 'reward_frame_stride': 5 ≥ the clip's 5 frames",
        ),
    ],
)
def test_load_errors_are_one_line_and_leave_nothing(pipes, kind, flags, needle, tmp_path, capsys):
    dirs, prompts = pipes
    flags = [{"QWEN": str(dirs["qwen_image"]), "ROOT": str(prompts.parent)}.get(f, f) for f in flags]
    if "--checkpoint" not in flags:
        flags += ["--checkpoint", str(dirs[kind])]
    run = tmp_path / "run"
    common = ["--model", kind, "--train_prompts", str(prompts), "--reward", "jpeg_compressibility"]
    assert _train_cli(run, *common, *flags) == 2
    err = capsys.readouterr().err.strip()  # diffusers' loading bars may come first: the error is one line
    assert needle in err.splitlines()[-1] and "Traceback" not in err, err
    assert not run.exists()  # nothing blocks the same command once fixed


def test_a_runs_final_as_a_training_checkpoint_says_what_it_is(pipes, tmp_path, capsys):
    run = tmp_path / "run"
    trained_run(pipes, "sd3", run)
    _, prompts = pipes
    flags = ["--model", "sd3", "--checkpoint", str(run / "final"), "--train_prompts", str(prompts)]
    assert _train_cli(tmp_path / "r2", *flags, "--reward", "jpeg_compressibility") == 2
    assert "it is a run's final/" in capsys.readouterr().err


def test_plain_prompts_with_the_default_reward_name_the_reward(pipes, tmp_path, capsys):
    _, prompts = pipes
    assert _train_cli(tmp_path / "run", "--train_prompts", str(prompts)) == 2
    err = capsys.readouterr().err
    assert "ShapeEval metadata" in err and "--reward" in err


def test_a_run_dir_without_a_checkpoint_says_so(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert _train_cli(run) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_device_flag_sets_the_device_and_names_a_bad_one(tmp_path):
    from flowcredit.errors import UserError

    run = tmp_path / "config.json"
    run.write_text(json.dumps({"device": "cuda:1"}))
    assert eval_cmd.config_from_args(cli_args())[0].device == "cpu"
    assert eval_cmd.config_from_args(cli_args(config=str(run)))[0].device == "cuda:1"  # the run's
    assert eval_cmd.config_from_args(cli_args(config=str(run), device="cpu"))[0].device == "cpu"
    with pytest.raises(UserError, match="device"):
        eval_cmd.config_from_args(cli_args(device="tpu"))
