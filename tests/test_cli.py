"""Every command turns a user error into one line on stderr and exit status 2; bugs keep tracebacks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowcredit import cli


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (["train", "--lr", "-1"], "config field 'lr': must be > 0"),
        (["train", "--lr", "fast"], "config field 'lr': cannot read 'fast'"),
        (["train", "--preset", "ppo"], "unknown preset 'ppo'"),
        (["train", "--learning_rate", "1e-3"], "unknown config key 'learning_rate'"),
        (["train", "--credit_options", '{"x": 1}'], "'flow_grpo' has no option 'x'"),
        (["train", "--config", "no_such.yaml"], "no_such.yaml"),
        (["train", "--resume", "no_such_run"], "no_such_run"),
        (["calibrate", "--sampler", "flow_sde"], "config field 'calibrate'"),
        (["eval", "--prompts", "no_such_prompts.jsonl"], "no_such_prompts.jsonl"),
        (["eval", "--model", "no_such_pkg:load"], "config field 'model'"),
        (["bench", "--presets", "flow_grpo,nope", "--quick"], "unknown preset 'nope'"),
        (["train", "--grop_size", "4"], "unknown config key 'grop_size'; did you mean 'group_size'?"),
        (["train", "--preset", "flow_grp"], "unknown preset 'flow_grp'; did you mean 'flow_grpo'?"),
    ],
)
def test_user_errors_are_one_line(argv, culprit, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"flowcredit {argv[0]}: error: ") and culprit in err, err


def test_bugs_keep_their_traceback(monkeypatch):
    import flowcredit.commands.demo as demo

    def broken(argv):
        raise KeyError("a bug")

    monkeypatch.setattr(demo, "main", broken)
    with pytest.raises(KeyError):
        cli.main(["demo"])


def test_exit_status_from_a_real_process(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "flowcredit", "train", "--lr", "-1"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == "flowcredit train: error: config field 'lr': must be > 0"


# --- a --checkpoint that is not a model, and --num_frames on an image model (issue 42, item 7) ---

SAMPLE = ["--prompt", "a red circle", "--n", "1", "--steps", "2", "--threads", "1", "--out", "s.png"]
EVAL = ["--max-prompts", "1", "--samples-per-prompt", "1", "--steps", "2", "--threads", "1"]
ARGS = {"sample": SAMPLE, "eval": EVAL}


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A finished tiny run's layout (docs/training.md) in the working directory: ``run/config.json``,
    ``run/checkpoint/`` (the training state) and ``run/final/`` (the trained model)."""
    import shutil

    from flowcredit.models import builtin_path

    monkeypatch.chdir(tmp_path)
    shutil.copytree(builtin_path(), tmp_path / "run" / "final")
    (tmp_path / "run" / "checkpoint").mkdir()
    (tmp_path / "run" / "checkpoint" / "state.json").write_text("{}")
    (tmp_path / "run" / "config.json").write_text('{"model": "tiny"}')
    return tmp_path / "run"


def command_error(capsys, command: str, *flags: str) -> str:
    assert cli.main([command, *flags, *ARGS.get(command, [])]) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"flowcredit {command}: error: config field "), err
    return err


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_a_misspelt_runs_final_names_the_right_one(run, command, capsys):
    err = command_error(capsys, command, "--checkpoint", "run/fina")
    assert err.endswith(
        "'checkpoint': no such directory 'run/fina': did you mean 'run/final' (the run's trained model)?"
    )


@pytest.mark.parametrize("command", ["sample", "eval"])
def test_a_run_folder_or_its_training_state_names_its_final(run, command, capsys):
    err = command_error(capsys, command, "--checkpoint", "run")
    assert err.endswith("'run' is a run folder, not a model; give --checkpoint run/final (its trained model)")
    err = command_error(capsys, command, "--checkpoint", "run/checkpoint")
    assert "'run/checkpoint' is a run's training state (for 'flowcredit train --resume run')" in err
    assert err.endswith("give --checkpoint run/final (its trained model)")
    assert cli.main([command, "--checkpoint", "run/final", *ARGS[command]]) == 0  # what the errors name


@pytest.mark.parametrize("command", ["sample", "eval", "train"])
def test_a_missing_tiny_checkpoint_is_one_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    give = "give 'builtin' or a directory with model.safetensors and config.json"
    err = command_error(capsys, command, "--model", "tiny", "--checkpoint", "/nonexistent")
    assert f"'checkpoint': no such directory '/nonexistent'; {give}" in err
    (tmp_path / "empty").mkdir()
    err = command_error(capsys, command, "--checkpoint", "empty")
    assert "'empty' is not a tiny-model checkpoint (it lacks model.safetensors and config.json)" in err
    (tmp_path / "empty" / "model_index.json").write_text("{}")
    assert "it is a diffusers pipeline: give its --model" in command_error(
        capsys, command, "--checkpoint", "empty"
    )
    assert not (tmp_path / "runs" / "demo").exists()  # train's failed start leaves no run_dir


@pytest.mark.parametrize(
    ("command", "flags", "model"),
    [
        ("sample", ["--frames", "5"], "tiny"),
        ("eval", ["--model", "sd3", "--frames", "33"], "sd3"),  # refused before any weights load
        ("train", ["--num_frames", "33"], "tiny"),
    ],
)
def test_num_frames_on_an_image_model_is_a_config_error(command, flags, model, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = command_error(capsys, command, *flags)
    frames = flags[-1]
    assert err.endswith(
        f"'num_frames': {frames} frames, but {model!r} makes images, not video; leave num_frames at 0 "
        "(only a video model such as 'wan' takes it)"
    )


def test_a_diffusers_checkpoint_near_a_run_names_its_final(run):
    """A misspelt ``RUN/final`` looks like a hub id (``owner/name``); beside a run folder it is a typo."""
    from flowcredit.errors import ConfigError
    from flowcredit.models.diffusers_checkpoint import check_checkpoint

    with pytest.raises(ConfigError, match=r"no such directory 'run/fina': did you mean 'run/final'"):
        check_checkpoint("run/fina", "StableDiffusion3Pipeline")
    with pytest.raises(
        ConfigError, match=r"it is a run folder: sample or evaluate its final/ with --checkpoint run/final"
    ):
        check_checkpoint("run", "StableDiffusion3Pipeline")


def test_a_misspelt_final_from_a_real_process(run):
    out = subprocess.run(
        [sys.executable, "-m", "flowcredit", "sample", "--checkpoint", "run/fianl", *SAMPLE],
        capture_output=True,
        text=True,
        cwd=run.parent,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "flowcredit sample: error: config field 'checkpoint': no such directory 'run/fianl': "
        "did you mean 'run/final' (the run's trained model)?"
    )
