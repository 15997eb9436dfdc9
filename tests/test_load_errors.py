"""A path the user names that is missing, truncated or malformed is one line naming the config field (or
flag, or reward option) and the path, with exit status 2, in every command (issue 53, item 3).

Each case runs the CLI in process and stops before any sampling: the model, reward and prompt set are
read when the run is built, so every case takes well under a second after the first import.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict

import pytest

from flowcredit import cli
from flowcredit.config import Config
from flowcredit.models import builtin_path

PICKSCORE = '{"pickscore": {"model_dir": "no_such_weights"}}'
SAMPLE = ["--prompt", "a red circle", "--n", "1", "--steps", "2", "--threads", "1", "--out", "s.png"]
EVAL = ["--max-prompts", "1", "--samples-per-prompt", "1", "--steps", "2", "--threads", "1"]
TRAIN = ["--iterations", "1", "--threads", "1", "--run_dir", "run"]
ARGS = {"sample": SAMPLE, "eval": EVAL, "train": TRAIN, "calibrate": ["--run_dir", "cal"]}


def args(command: str, flags: tuple[str, ...]) -> list[str]:
    """The command line; ``--resume`` takes the run's own settings, so no others are added."""
    return [command, *flags] if "--resume" in flags else [command, *flags, *ARGS.get(command, [])]


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Broken inputs in the working directory: a tiny checkpoint with truncated weights (``trunc``), one
    with a config.json that is not JSON (``badjson``) and one with an unknown key (``badkey``), YAML that
    does not parse, a prompt file that is not UTF-8, an HPS checkpoint file, and two run folders to
    resume: one whose config.json is cut short and one whose training state is."""
    monkeypatch.chdir(tmp_path)
    for name in ("trunc", "badjson", "badkey"):
        shutil.copytree(builtin_path(), name)
    weights = (tmp_path / "trunc" / "model.safetensors").read_bytes()
    (tmp_path / "trunc" / "model.safetensors").write_bytes(weights[:3000])
    (tmp_path / "badjson" / "config.json").write_text('{"vocab": [')
    config = json.loads((tmp_path / "badkey" / "config.json").read_text())
    (tmp_path / "badkey" / "config.json").write_text(json.dumps({**config, "colour": 1}))
    (tmp_path / "bad.yaml").write_text("lr: [1\n")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00 not text")
    (tmp_path / "hps.safetensors").write_bytes(b"any")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text('{"lr": ')
    state = tmp_path / "cutstate" / "checkpoint"
    state.mkdir(parents=True)
    (tmp_path / "cutstate" / "config.json").write_text(json.dumps(asdict(Config(run_dir="cutstate"))))
    (state / "state.json").write_text('{"iteration": ')
    return tmp_path


def one_line_error(capsys, command: str, *flags: str) -> str:
    """Run ``flowcredit command flags…``: exit 2, and one line on stderr (no traceback)."""
    assert cli.main(args(command, flags)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"flowcredit {command}: error: "), err
    return err


CHECKPOINTS = [
    ("trunc", "SafetensorError"),  # the issue's: head -c 3000 model.safetensors
    ("badjson", "JSONDecodeError"),
    ("badkey", "unknown TinyConfig keys ['colour']"),
]


@pytest.mark.parametrize("command", ["train", "sample", "eval"])
@pytest.mark.parametrize(("checkpoint", "cause"), CHECKPOINTS)
def test_a_broken_tiny_checkpoint(files, capsys, command, checkpoint, cause):
    err = one_line_error(capsys, command, "--checkpoint", checkpoint)
    assert f"config field 'checkpoint' = '{checkpoint}': cannot read its " in err and cause in err, err
    assert not (files / "run").exists()  # train's failed start leaves no run_dir


@pytest.mark.parametrize("command", ["train", "eval", "serve-reward"])
def test_missing_reward_weights(files, capsys, command):
    flag = "--reward-options" if command == "serve-reward" else "--reward_options"
    err = one_line_error(capsys, command, "--reward", "pickscore", flag, PICKSCORE)
    assert "reward 'pickscore': option 'model_dir' = 'no_such_weights': not an existing directory" in err


@pytest.mark.parametrize(
    ("options", "culprit"),
    [
        ({"checkpoint": "no_such.safetensors"}, "option 'checkpoint' = 'no_such.safetensors'"),
        ({"checkpoint": "hps.safetensors", "bpe_path": "no.gz"}, "option 'bpe_path' = 'no.gz'"),
        ({"checkpoint": "hps.safetensors"}, "option 'bpe_path' is not set and open_clip is not installed"),
    ],
)
def test_missing_hps_files(files, capsys, monkeypatch, options, culprit):
    import flowcredit.rewards.hps as hps

    monkeypatch.setattr(hps, "default_bpe_path", lambda: None)  # open_clip absent
    err = one_line_error(capsys, "train", "--reward", "hps", "--reward_options", json.dumps({"hps": options}))
    assert f"reward 'hps': {culprit}" in err, err


def test_missing_imagereward_weights(files, capsys):
    options = '{"imagereward": {"model_dir": "no_such_dir"}}'
    err = one_line_error(capsys, "train", "--reward", "imagereward", "--reward_options", options)
    assert "reward 'imagereward': option 'model_dir' = 'no_such_dir'" in err


@pytest.mark.parametrize("command", ["train", "eval", "calibrate", "sample"])
def test_a_config_file_that_does_not_parse(files, capsys, command):
    err = one_line_error(capsys, command, "--config", "bad.yaml")
    assert "--config 'bad.yaml': cannot read it (" in err and "Error" in err, err


@pytest.mark.parametrize(
    ("command", "flags", "culprit"),
    [
        ("train", ["--train_prompts", "binary.jsonl"], "config field 'train_prompts' = 'binary.jsonl'"),
        ("train", ["--eval_prompts", "binary.jsonl"], "config field 'eval_prompts' = 'binary.jsonl'"),
        ("eval", ["--prompts", "binary.jsonl"], "--prompts 'binary.jsonl'"),
    ],
)
def test_a_prompt_file_that_is_not_text(files, capsys, command, flags, culprit):
    err = one_line_error(capsys, command, *flags)
    assert f"{culprit}: cannot read it (UnicodeDecodeError" in err, err


@pytest.mark.parametrize(
    ("run", "culprit"),
    [
        ("cut", "--resume 'cut/config.json': cannot read it (JSONDecodeError"),
        ("cutstate", "--resume 'cutstate': cannot read its checkpoint (JSONDecodeError"),
    ],
)
def test_a_run_to_resume_that_is_cut_short(files, capsys, run, culprit):
    assert culprit in one_line_error(capsys, "train", "--resume", run)


# --- the registries' net: a loader or reward factory outside the package that cannot read a file ---


def unreadable_loader(cfg):
    """A model loader whose weights file is missing (``--model`` of a plugin)."""
    raise FileNotFoundError(2, "No such file or directory", f"{cfg.checkpoint}/weights.bin")


def unreadable_reward(*, weights):
    """A reward factory outside the package whose ``weights`` option names a file not there."""
    raise FileNotFoundError(2, "No such file or directory", weights)


def test_a_plugin_loader_that_cannot_read_its_checkpoint(files, capsys, monkeypatch):
    from flowcredit.models.registry import MODELS

    monkeypatch.setitem(MODELS, "unreadable", f"{__name__}:unreadable_loader")
    err = one_line_error(capsys, "sample", "--model", "unreadable", "--checkpoint", "ckpt")
    assert "config field 'checkpoint': 'ckpt': the 'unreadable' loader cannot read it (FileNotFound" in err
    assert "ckpt/weights.bin" in err


def test_a_plugin_reward_that_cannot_read_its_weights(files, capsys):
    name = f"{__name__}:unreadable_reward"
    options = json.dumps({name: {"weights": "w.bin"}})
    err = one_line_error(capsys, "train", "--reward", name, "--reward_options", options)
    assert f"reward '{name}': FileNotFoundError: " in err and "'w.bin'" in err


def test_a_json_config_is_read_as_json(tmp_path):
    from flowcredit.config import read_mapping

    (tmp_path / "config.json").write_text(json.dumps({"lr": 1e-05}))  # YAML 1.1 reads 1e-05 as a string
    assert read_mapping("--config", tmp_path / "config.json") == {"lr": 1e-05}
