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
