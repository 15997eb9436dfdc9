"""The papers' recipes (configs/papers/*.yaml, docs/reproducing.md): each file loads, says where every
value comes from, does not depend on ``--preset``, and runs one iteration through ``flowcredit train
--config`` on a tiny random SD3 pipeline with tiny reward models (GenEval: a tiny Mask2Former + CLIP,
PickScore: a tiny CLIP, OCR: the real rapidocr, which ships its models). Only sizes are shrunk
(resolution, steps, groups, prompts, batch, evaluation, calibration rounds); every method field runs
as written, and the run's config.json must hold the recipe's values for every field not shrunk."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from safetensors import safe_open

pytest.importorskip("diffusers", reason="needs the 'diffusers' extra: pip install -e '.[test]'")

import test_geneval_mask2former  # noqa: E402
import test_rewards_clip  # noqa: E402
from tiny_diffusers import SIZE, build_sd3  # noqa: E402

from flowcredit import cli  # noqa: E402
from flowcredit.presets import PRESETS, load_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
PAPERS = Path(__file__).resolve().parents[1] / "configs" / "papers"
EXPECTED = [
    "dense_grpo_geneval",
    "dense_grpo_ocr",
    "dense_grpo_pickscore",
    "flow_grpo_geneval",
    "flow_grpo_ocr",
    "flow_grpo_pickscore",
    "stepwise_grpo_geneval",
    "stepwise_grpo_pickscore",
    "tp_grpo_geneval",
    "tp_grpo_ocr",
    "tp_grpo_pickscore",
]
SOURCES = ("from the paper", "Flow-GRPO's public config", "our choice")
"""How the comment above every field starts (docs/reproducing.md)."""
SHRUNK = {  # sizes only: a recipe's method fields (sampler, noise, window, credit, β, ...) run as written
    "resolution": str(SIZE),
    "num_steps": "4",
    "eval_num_steps": "4",
    "group_size": "4",
    "prompts_per_iter": "2",
    "batch_size": "4",
    "num_eval_prompts": "2",
    "eval_samples_per_prompt": "1",
    "iterations": "1",
    "calib_groups": "1",
    "calib_max_iters": "2",
}
"""Overrides of every run (with --checkpoint, --reward_options, the prompt files and --run_dir)."""
OUTPUTS = ("log_with", "threads")  # where the test run writes and how many threads it takes
GENEVAL_PROMPTS = [
    {"tag": "single_object", "include": [{"class": "cup", "count": 1}], "prompt": "a photo of a cup"},
    {
        "tag": "counting",
        "include": [{"class": "dog", "count": 2}],
        "exclude": [{"class": "dog", "count": 3}],
        "prompt": "a photo of two dogs",
    },
    {
        "tag": "colors",
        "include": [{"class": "cup", "count": 1, "color": "red"}],
        "prompt": "a photo of a red cup",
    },
]
OCR_PROMPTS = ['a sign that says "Hello"', 'a poster with the text "Open"', 'a red sign saying "Stop"']
TEXT_PROMPTS = ["a photo of a cat", "a red square on a blue sign", "a small green triangle"]


def recipe(name: str) -> dict:
    return yaml.safe_load((PAPERS / f"{name}.yaml").read_text())


def test_the_recipes_are_the_expected_eleven():
    """A new recipe needs an entry in EXPECTED (and so a run below)."""
    assert sorted(p.stem for p in PAPERS.glob("*.yaml")) == EXPECTED
    assert not [p for p in PAPERS.iterdir() if p.suffix != ".yaml"]


@pytest.mark.parametrize("name", EXPECTED)
def test_every_field_says_where_its_value_comes_from(name):
    lines = (PAPERS / f"{name}.yaml").read_text().splitlines()
    keys = 0
    for k, line in enumerate(lines):
        if not re.match(r"^[a-z_0-9]+:", line):
            continue
        keys += 1
        assert " # " not in line, f"{name}: the comment goes above {line!r}"
        j = k  # the start of the comment block right above the field
        while j > 0 and lines[j - 1].startswith("# ") and not lines[j - 1].startswith("# ====="):
            j -= 1
        assert j < k and lines[j][2:].startswith(SOURCES), f"{name}: {line!r} does not say its source"
    assert keys == len(recipe(name))


@pytest.mark.parametrize("name", EXPECTED)
def test_a_recipe_does_not_depend_on_the_preset(name):
    """``flowcredit train --preset P --config FILE`` gives one config whatever P is."""
    path = str(PAPERS / f"{name}.yaml")
    configs = {p: dataclasses.asdict(load_config(p, path, [])) for p in PRESETS}
    first = next(iter(configs.values()))
    assert all(c == first for c in configs.values()), [p for p, c in configs.items() if c != first]
    method, bench = name.rsplit("_", 1)
    assert first["model"] == "sd3" and first["reward"] == bench and first["resolution"] == 512
    assert first["credit"] == PRESETS[method]().credit and first["sampler"] == PRESETS[method]().sampler


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny SD3 pipeline, reward weights and prompt files shared by every run."""
    root = tmp_path_factory.mktemp("recipes")
    sd3 = build_sd3(root / "sd3")
    with pytest.MonkeyPatch.context() as mp:  # the colour words GenEval's colour classifier asks for
        mp.setattr(test_rewards_clip, "WORDS", test_geneval_mask2former.CLIP_WORDS)
        geneval_clip = test_rewards_clip.save_tiny_clip(root / "geneval_clip")
    m2f = test_geneval_mask2former.save_tiny_mask2former(root / "m2f")
    pick = test_rewards_clip.save_tiny_clip(root / "pickscore")
    geneval = root / "geneval.jsonl"
    geneval.write_text("".join(json.dumps(m) + "\n" for m in GENEVAL_PROMPTS))
    (root / "ocr.txt").write_text("\n".join(OCR_PROMPTS) + "\n")
    (root / "text.txt").write_text("\n".join(TEXT_PROMPTS) + "\n")
    options = {
        "geneval": {"geneval": {"detector": "mask2former", "score": "partial", "model_dir": str(m2f)}},
        "ocr": None,
        "pickscore": {"pickscore": {"model_dir": str(pick), "divisor": 26, "device": "cpu"}},
    }
    options["geneval"]["geneval"] |= {"clip_dir": str(geneval_clip), "device": "cpu", "jpeg_quality": 75}
    prompts = {"geneval": geneval, "ocr": root / "ocr.txt", "pickscore": root / "text.txt"}
    return {"sd3": sd3, "options": options, "prompts": prompts, "root": root}


@pytest.mark.parametrize("name", EXPECTED)
def test_one_iteration_of_the_recipe(name, tiny):
    bench = name.rsplit("_", 1)[1]
    run = tiny["root"] / "runs" / name
    argv = ["train", "--config", str(PAPERS / f"{name}.yaml"), "--checkpoint", str(tiny["sd3"])]
    if tiny["options"][bench] is not None:
        argv += ["--reward_options", json.dumps(tiny["options"][bench])]
    if bench == "geneval":  # the run's options are the recipe's but for the weights' directories
        jpeg = json.loads(recipe(name)["reward_options"])["geneval"]["jpeg_quality"]
        assert tiny["options"][bench]["geneval"]["jpeg_quality"] == jpeg
    prompts = str(tiny["prompts"][bench])
    argv += ["--train_prompts", prompts, "--eval_prompts", prompts, "--run_dir", str(run)]
    argv += ["--log_with", "none", "--threads", "1"]
    for key, value in SHRUNK.items():
        argv += [f"--{key}", value]
    assert cli.main(argv) == 0

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "reward/mean" in r]
    assert [r["iteration"] for r in trained] == [1] and math.isfinite(trained[0]["reward/mean"])
    if bench == "pickscore" or "stats/optimizer_steps" in trained[0]:
        # PickScore is continuous, so its groups never tie and the PPO update runs; GenEval's and OCR's
        # discrete scores tie within every group on the tiny random models (all groups are dropped)
        assert trained[0]["stats/optimizer_steps"] >= 1 and trained[0]["stats/first_ratio_maxdev"] == 0.0
    assert "eval/test/soft" in rows[-1]
    with safe_open(str(run / "final" / "pytorch_lora_weights.safetensors"), "pt") as f:
        wrapped = {k.split(".lora_")[0] for k in f.keys()}  # the exported LoRA covers every target
    for target in recipe(name)["lora_targets"].split(","):
        assert any(m.endswith("." + target) for m in wrapped), f"{name}: no LoRA on {target}"

    saved = json.loads((run / "config.json").read_text())
    given = {"checkpoint", "reward_options", "train_prompts", "eval_prompts", "run_dir", *OUTPUTS, *SHRUNK}
    for key, value in recipe(name).items():
        if key not in given:
            assert saved[key] == value, (
                f"{name}: config.json {key} = {saved[key]!r}, the recipe says {value!r}"
            )
    if saved["calibrate"]:
        assert json.loads((run / "psi.json").read_text())
