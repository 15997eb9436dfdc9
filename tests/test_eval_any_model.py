"""``flowcredit eval`` / ``sample`` for any adapter and any reward, and the evaluation settings apart
from training's (``eval_num_steps``, ``eval_guidance_scale``, ``eval_reward``), in a run and from
``--config``."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flowcredit.commands import eval as eval_cmd
from flowcredit.presets import PRESETS
from flowcredit.rewards import get_reward
from flowcredit.run import evaluation as ev
from flowcredit.validation import validate

PROMPTS = "a red square\na photo of a cat\n"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")
    from tiny_diffusers import build_sd3, build_wan

    root = tmp_path_factory.mktemp("eval_pipes")
    return {"sd3": build_sd3(root / "sd3"), "wan": build_wan(root / "wan")}


def test_eval_and_sample_on_a_tiny_sd3_pipeline_with_jpeg(pipes, tmp_path):
    from flowcredit.models.sd3 import SD3FlowModel

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    model_args = ["--model", "sd3", "--checkpoint", str(pipes["sd3"]), "--resolution", "32"]
    model_args += ["--dtype", "float32", "--threads", "1"]
    argv = [*model_args, "--prompts", str(prompts), "--reward", "jpeg_compressibility", "--steps", "3"]
    argv += ["--samples-per-prompt", "2", "--cfg", "2.0", "--out", str(tmp_path / "out")]
    assert eval_cmd.main_eval(argv) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert (result["reward"], result["steps"], result["cfg"]) == ("jpeg_compressibility", 3, 2.0)
    # the scores are the reward of the images ODE-sampled from the seed's noise with these settings
    model = SD3FlowModel.from_pretrained(str(pipes["sd3"]), dtype="float32", device="cpu", resolution=32)
    prompt_rows = ["a red square"] * 2 + ["a photo of a cat"] * 2
    images = ev.sample(model, prompt_rows, ev.initial_noise(4, model.latent_shape, 0), 3, None, 2.0)
    expected = get_reward("jpeg_compressibility")(images, prompt_rows, [{}] * 4)
    assert torch.allclose(torch.tensor(result["per_sample"]["0"]["soft"]), expected, atol=1e-4)
    assert (tmp_path / "out" / "grid.png").stat().st_size > 0
    out = tmp_path / "sample.png"
    assert (
        eval_cmd.main_sample(
            [*model_args, "--prompt", "a red square", "--n", "2", "--steps", "2", "--out", str(out)]
        )
        == 0
    )
    assert out.stat().st_size > 0


def test_eval_takes_the_eval_settings_of_a_config_file(pipes, tmp_path):
    """``--config``: the model and the run's evaluation settings (steps, guidance, reward); a video
    model's clips are scored per frame and shown as frame strips."""
    from PIL import Image

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    config = {"model": "wan", "checkpoint": str(pipes["wan"]), "resolution": 32, "dtype": "float32"}
    config |= {"num_frames": 5, "num_steps": 8, "eval_num_steps": 2, "guidance_scale": 3.0}
    config |= {"reward": "shapes", "eval_reward": "jpeg_compressibility", "eval_guidance_scale": 1.5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    argv = ["--config", str(tmp_path / "config.json"), "--prompts", str(prompts), "--threads", "1"]
    argv += ["--samples-per-prompt", "1", "--out", str(tmp_path / "out")]
    assert eval_cmd.main_eval(argv) == 0
    result = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert (result["reward"], result["steps"], result["cfg"]) == ("jpeg_compressibility", 2, 1.5)
    grid = Image.open(tmp_path / "out" / "grid.png")
    assert grid.width > 4 * grid.height // 2  # a row of 5-frame strips, not square tiles
    assert eval_cmd.main_eval([*argv[:-2], "--steps", "3", "--out", str(tmp_path / "o2")]) == 0
    assert json.loads((tmp_path / "o2" / "eval.json").read_text())["steps"] == 3  # a flag wins
    out = tmp_path / "clips.png"
    sample_argv = ["--config", str(tmp_path / "config.json"), "--prompt", "a red square", "--n", "2"]
    assert eval_cmd.main_sample([*sample_argv, "--threads", "1", "--out", str(out)]) == 0
    strips = Image.open(out)
    assert strips.width > 2 * strips.height  # two rows, each a strip of 5 frames


def test_a_runs_evaluation_uses_the_eval_fields(tmp_path):
    """The run's evaluation samples with ``eval_num_steps`` / ``eval_guidance_scale`` and scores with
    ``eval_reward``, not the training settings (the tiny model, trained on ``shapes``)."""
    from flowcredit.run.session import build_session

    cfg = dataclasses.replace(
        PRESETS["flow_grpo"](),
        run_dir=str(tmp_path / "run"),
        num_steps=6,
        eval_num_steps=3,
        eval_guidance_scale=2.5,
        eval_reward="jpeg_compressibility",
        num_eval_prompts=2,
        num_train_prompts=40,
        eval_samples_per_prompt=2,
        threads=1,
    )
    s = build_session(validate(cfg))
    got = ev.evaluate_policy(s, None)
    assert set(got) == {"eval/test/soft"}  # no pass/fail (strict) for a non-ShapeEval reward
    with torch.no_grad():
        want = ev.evaluate_reward(
            s.model, s.eval_metas, get_reward("jpeg_compressibility"), cfg.eval_seed, 2, 3, cfg.shift, 2.5
        )
    assert got["eval/test/soft"] == pytest.approx(want["table"]["overall"]["soft"], abs=1e-6)
    with torch.no_grad():
        other = ev.evaluate_reward(
            s.model, s.eval_metas, get_reward("jpeg_compressibility"), cfg.eval_seed, 2, 6, cfg.shift, None
        )
    assert got["eval/test/soft"] != pytest.approx(other["table"]["overall"]["soft"], abs=1e-6)
