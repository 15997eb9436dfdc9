"""Pretraining (determinism, files), evaluation (exact repeatability) and the eval/sample CLIs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flowcredit import cli
from flowcredit.commands import eval as eval_cmd
from flowcredit.commands import pretrain
from flowcredit.models import TinyFlowModel, load_builtin
from flowcredit.run import evaluation as ev
from flowcredit.tasks.shapes import load_prompts

torch.set_num_threads(2)


def test_pretrain_is_deterministic_and_writes_files(tmp_path):
    argv = ["--steps", "3", "--batch-size", "4", "--warmup", "2", "--quiet", "--seed", "7"]
    assert pretrain.main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert pretrain.main([*argv, "--out", str(tmp_path / "b")]) == 0
    a, b = (
        load_file(str(tmp_path / "a" / "model.safetensors")),
        load_file(str(tmp_path / "b" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fresh = TinyFlowModel(TinyFlowModel.load(tmp_path / "a").config, seed=7).net.state_dict()
    assert any(not torch.equal(fresh[k], a[k]) for k in a)  # the weights moved
    assert json.loads((tmp_path / "a" / "pretrain.json").read_text())["steps_done"] == 3
    assert not list(tmp_path.glob("*/*.tmp"))


def test_lr_schedule_and_balanced_batch():
    assert pretrain.lr_at(0, 100, 1.0, 10) == 0.1 and pretrain.lr_at(9, 100, 1.0, 10) == 1.0
    assert abs(pretrain.lr_at(100, 100, 1.0, 10) - 0.1) < 1e-9
    import numpy as np

    train = load_prompts("train")
    by_cat = [[m for m in train if m["category"] == c] for c in sorted({m["category"] for m in train})]
    images, metas = pretrain.balanced_batch(np.random.default_rng(0), by_cat, 5, 32)
    assert images.shape == (5, 3, 32, 32) and images.dtype == np.float32 and len(metas) == 5
    assert 0.0 <= images.min() and images.max() <= 1.0


def test_sample_and_evaluate_are_repeatable():
    model = load_builtin()
    metas = load_prompts("test")[:3]
    kw = {"seed": 3, "samples_per_prompt": 2, "num_steps": 3}
    first, second = ev.evaluate(model, metas, **kw), ev.evaluate(model, metas, **kw)
    assert first == second
    assert set(first["table"]) >= {"overall"} and len(first["soft"]) == 6
    images = ev.sample(model, ["two red circles"] * 2, ev.initial_noise(2, model.latent_shape, 0), 3)
    assert images.shape == (2, 3, 32, 32) and 0.0 <= images.min() and images.max() <= 1.0
    assert model.guidance_scale == load_builtin().guidance_scale  # sample() restores an override


def test_eval_cli_on_two_prompts(tmp_path, capsys):
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps(m) + "\n" for m in load_prompts("test")[:2]))
    argv = ["--prompts", str(prompts), "--seeds", "0,1", "--samples-per-prompt", "2", "--steps", "2"]
    assert eval_cmd.main_eval([*argv, "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert set(result["tables"]) == {"0", "1"} and "overall" in result["across_seeds"]
    assert (tmp_path / "out" / "grid.png").stat().st_size > 0
    assert "noise floor" in capsys.readouterr().out


def test_sample_cli(tmp_path, capsys):
    out = tmp_path / "s.png"
    assert (
        eval_cmd.main_sample(["--prompt", "two red circles", "--n", "2", "--steps", "2", "--out", str(out)])
        == 0
    )
    assert out.stat().st_size > 0
    assert cli.main(["sample", "--prompt", "two purple circles", "--n", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'purple'" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_eval_cli_with_any_reward_and_a_text_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "free.txt"
    prompts.write_text("two red circles\na blue square\n")  # plain prompts: no ShapeEval metadata
    argv = ["--prompts", str(prompts), "--reward", "jpeg_compressibility", "--seeds", "0,1"]
    argv += ["--samples-per-prompt", "2", "--steps", "2", "--out", str(tmp_path / "out")]
    assert eval_cmd.main_eval(argv) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert result["reward"] == "jpeg_compressibility"
    soft = result["per_sample"]["0"]["soft"]
    assert len(soft) == 4 and result["tables"]["0"]["overall"]["soft"] == pytest.approx(sum(soft) / 4)
    assert (tmp_path / "out" / "grid.png").stat().st_size > 0
    assert cli.main(["eval", "--prompts", str(prompts)]) == 2  # the ShapeEval table needs its metadata
    assert "free.txt" in capsys.readouterr().err
