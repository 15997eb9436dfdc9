"""GenEval through the CLI on the built-in model: ``flowcredit eval --reward geneval`` prints the
per-tag table, a run trains and evaluates with it, and a bad metadata line stops the start."""

import json
from importlib import resources

from flowcredit import cli
from flowcredit.tasks.geneval.rules import TAGS

SHAPES_GENEVAL = str(resources.files("flowcredit") / "tasks" / "data" / "geneval_shapes_test.jsonl")
OPTIONS = json.dumps({"geneval": {"detector": "shapes"}})


def test_eval_prints_the_per_tag_table(tmp_path, capsys, one_thread):
    argv = ["eval", "--reward", "geneval", "--reward_options", OPTIONS, "--prompts", SHAPES_GENEVAL]
    argv += ["--samples-per-prompt", "1", "--threads", "1", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for tag in TAGS:
        assert any(line.startswith(tag) for line in out.splitlines()), tag
    result = json.loads((tmp_path / "eval.json").read_text())
    table = result["tables"]["0"]
    assert set(table) == {*TAGS, "overall"} and table["overall"]["n"] == 86
    strict = result["per_sample"]["0"]["strict"]
    assert set(strict) <= {0.0, 1.0}
    assert table["overall"]["strict"] == sum(table[t]["strict"] for t in TAGS) / len(TAGS)


def test_a_run_trains_and_evaluates_with_geneval(tmp_path, one_thread):
    run = tmp_path / "run"
    argv = ["train", "--preset", "flow_grpo", "--reward", "geneval", "--reward_options", OPTIONS]
    argv += ["--train_prompts", SHAPES_GENEVAL, "--eval_prompts", SHAPES_GENEVAL, "--iterations", "1"]
    argv += ["--prompts_per_iter", "2", "--group_size", "4", "--num_steps", "4", "--num_eval_prompts", "12"]
    argv += ["--eval_samples_per_prompt", "1", "--log_with", "none", "--run_dir", str(run), "--threads", "1"]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in rows if "eval/test/strict" in r]
    assert evaluated and any(k.startswith("eval/test/position/") for k in evaluated[-1])
    assert any("reward/mean" in r and 0 <= r["reward/mean"] <= 1 for r in rows)


def test_a_metadata_line_without_include_is_named(tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    lines = (
        resources.files("flowcredit")
        .joinpath("tasks/data/geneval_shapes_test.jsonl")
        .read_text()
        .splitlines()
    )
    bad.write_text(lines[0] + "\n" + json.dumps({"tag": "colors", "prompt": "a red circle"}) + "\n")
    argv = ["train", "--preset", "flow_grpo", "--reward", "geneval", "--reward_options", OPTIONS]
    argv += ["--train_prompts", str(bad), "--run_dir", str(tmp_path / "run"), "--log_with", "none"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        "prompts.jsonl: line 2: geneval reward: prompt 'a red circle': GenEval metadata needs a non-empty "
        "'include' list"
    )
