"""The command line explains itself (issue 58): ``train --help`` lists every config field with its doc,
type and default; long options take both spellings and no abbreviations; a misspelt key or preset is
one line with "did you mean"; the config still comes from preset → YAML → flags, plugins imported
first. All in-process parser calls: nothing trains."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from flowcredit import cli
from flowcredit.cli_args import ArgParser, add_config_fields, config_sections
from flowcredit.commands import bench, calibrate, train
from flowcredit.commands import eval as eval_command
from flowcredit.config import Config
from flowcredit.presets import PRESETS, load_config

FIELDS = [f.name for f in dataclasses.fields(Config)]


def help_of(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def squeezed(text: str) -> str:
    return "".join(text.split())  # argparse wraps help lines anywhere, hyphens included


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_every_field_has_a_section_and_a_doc():
    found = {name: doc for entries in config_sections().values() for name, doc in entries}
    assert list(found) == FIELDS
    assert all(found.values()), [name for name, doc in found.items() if not doc]
    assert list(config_sections())[:2] == ["run", "model"]


def test_train_help_lists_every_field_with_its_doc_type_and_default(capsys):
    out = help_of(["train"], capsys)
    flat = squeezed(out)
    for title, entries in config_sections().items():
        assert f"config: {title}:" in out
        for name, doc in entries:
            assert f"--{name} " in out, name
            assert squeezed(doc.replace("``", "")) in flat, name
    assert "--group_sizeINTSamplesperprompt(theGRPOgroup).(default16)" in flat
    assert "--calibrate{true,false}" in flat and "(defaultfalse)" in flat
    assert "--group-size" not in out  # one spelling shown
    assert "[--FIELD VALUE ...]" in out.split("\n\n")[0]  # the usage line stays short


def test_calibrate_help_describes_it_and_lists_run_dir(capsys):
    out = help_of(["calibrate"], capsys)
    assert "--run_dir STR" in out and "psi.json" in out and "--psi_path" in out
    assert "--calibrate {true,false}" not in out  # the command sets it


@pytest.mark.parametrize("flag", ["--samples_per_prompt", "--samples-per-prompt"])
def test_eval_takes_both_spellings(flag, capsys, tmp_path, monkeypatch):
    assert eval_command._eval_parser().parse_args([flag, "3"]).samples_per_prompt == 3
    monkeypatch.chdir(tmp_path)  # parsed, then the first check stops it: the prompt file
    assert cli.main(["eval", flag, "2", "--prompts", "no_such.jsonl"]) == 2
    assert "no_such.jsonl" in one_error_line(capsys)


def test_both_spellings_give_the_same_overrides():
    parse = train._parser().parse_with_overrides
    underscores = parse(["--run_dir", "x", "--group_size", "4", "--shared_noise", "true"])
    hyphens = parse(["--run-dir", "x", "--group-size=4", "--shared-noise", "true"])
    assert underscores == hyphens
    assert underscores[1] == ["--run_dir", "x", "--group_size", "4", "--shared_noise", "true"]
    assert eval_command._eval_parser().parse_args(["--reward-options", "{}"]).reward_options == "{}"


def test_a_config_value_is_the_next_word_even_if_it_starts_with_a_dash():
    _, overrides = train._parser().parse_with_overrides(["--shift", "-1e-3", "--lr", "-1"])
    assert overrides == ["--shift", "-1e-3", "--lr", "-1"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train", "--grop_size", "4"], "unknown config key 'grop_size'; did you mean 'group_size'?"),
        (["train", "--grop-size=4"], "unknown config key 'grop_size'; did you mean 'group_size'?"),
        (["calibrate", "--calib_max_iter", "3"], "did you mean 'calib_max_iters'"),
        (["train", "--preset", "tp_grop"], "unknown preset 'tp_grop'; did you mean 'tp_grpo'?"),
        (["train", "--group_size", "four"], "config field 'group_size': cannot read 'four' as int"),
    ],
)
def test_a_misspelt_key_or_preset_is_one_line_with_a_suggestion(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = one_error_line(capsys)
    assert err.startswith(f"flowcredit {argv[0]}: error: ") and message in err, err


@pytest.mark.parametrize("argv", [["--seed", "3"], ["--seed=3"], ["--run-dir", "x"]])
def test_bench_refuses_seed_and_run_dir(argv, capsys, tmp_path, monkeypatch):
    """``--seed`` was once read as ``--seeds`` (argparse's prefix matching); docs/benchmarks.md says
    the bench rejects it."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--quick", *argv]) == 2
    err = one_error_line(capsys)
    assert argv[0].split("=")[0] in err and "--seeds" in err, err
    assert not (tmp_path / "runs").exists()  # refused before anything was made


def test_no_abbreviations():
    parser = ArgParser(prog="x")
    parser.add_argument("--seeds")
    with pytest.raises(SystemExit):
        parser.parse_args(["--seed", "3"])
    args, rest = bench._parser().parse_known_args(["--pres", "flow_grpo"])
    assert rest == ["--pres", "flow_grpo"]


def test_a_command_option_wins_over_the_field_of_that_name():
    parser = ArgParser(prog="x")
    parser.add_argument("--seed", type=int, default=7)
    add_config_fields(parser)
    args, overrides = parser.parse_with_overrides(["--seed", "3", "--lr", "0.1"])
    assert args.seed == 3 and overrides == ["--lr", "0.1"]


def test_preset_yaml_flags_order_and_a_plugin_preset(tmp_path, monkeypatch):
    (tmp_path / "my.yaml").write_text("lr: 0.5\ngroup_size: 8\n")
    args, overrides = train._parser().parse_with_overrides(
        ["--preset", "tp_grpo", "--config", str(tmp_path / "my.yaml"), "--lr", "0.25", "--lr", "0.125"]
    )
    cfg = load_config(args.preset, args.config, overrides)
    assert (cfg.sampler, cfg.group_size, cfg.lr) == ("cps", 8, 0.125)  # preset, YAML, the last flag
    plugin = tmp_path / "cli_help_plugin.py"
    plugin.write_text(
        "from flowcredit.config import Config\nfrom flowcredit.presets import register_preset\n"
        "register_preset('cli_help_preset', lambda: Config(lr=0.01), compared=False)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:  # the preset exists only once --imports has run: imports come before the preset is looked up
        argv = ["--preset", "cli_help_preset", "--group_size", "4", "--imports", "cli_help_plugin"]
        args, overrides = calibrate._parser().parse_with_overrides(argv)
        cfg = load_config(args.preset, args.config, overrides)
        assert (cfg.lr, cfg.group_size, cfg.imports) == (0.01, 4, "cli_help_plugin")
    finally:
        PRESETS.pop("cli_help_preset", None)
        sys.modules.pop("cli_help_plugin", None)


def test_bench_progress_bar_names_each_run_and_ends_full(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run_cell", lambda cell, seed, runs: runs / f"{cell['name']}-seed{seed}")
    monkeypatch.setattr(bench, "_warm_imports", lambda: None)
    args = bench._parser().parse_args(["--jobs", "1"])
    jobs = [({"name": name}, seed) for seed in (0, 1) for name in ("flow_grpo", "tp_grpo")]
    done = bench.run_all(args, jobs, tmp_path, after=lambda run_dir: run_dir)
    assert done[("tp_grpo", 1)] == tmp_path / "tp_grpo-seed1" and len(done) == 4
    err = capsys.readouterr().err
    assert "bench tp_grpo seed 1" in err and "100%" in err and "4/4" in err


def test_demo_takes_both_spellings_of_run_dir_and_has_help(capsys):
    """``demo --run-dir X`` is the run directory (not overridden by the fresh runs/demo-<time>)."""
    from flowcredit.commands.demo import _parser

    for flag in ("--run-dir", "--run_dir"):
        _, overrides = _parser().parse_with_overrides([flag, "runs/x", "--iterations", "2"])
        assert overrides[::2] == ["--run_dir", "--iterations"] and overrides[1] == "runs/x"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--help"])
    assert exit_.value.code == 0
    assert "--group_size" in capsys.readouterr().out
