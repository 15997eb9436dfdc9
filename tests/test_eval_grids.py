"""A run's evaluation grids (scores, pass/fail frames, the before/after pair), the progress bars of
``flowcredit eval`` and of the calibration, and ``flowcredit eval`` reproducing a run's own score."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from loop_probes import SMALL_RUN, small_config
from PIL import Image

from flowcredit.commands.demo import afterword
from flowcredit.commands.eval import main_eval
from flowcredit.config import from_dict
from flowcredit.presets import PRESETS
from flowcredit.run.calibrate import calibrate_psi
from flowcredit.run.evaluation import evaluate
from flowcredit.run.grids import FAIL, PASS, before_after, scored_grid
from flowcredit.run.session import build_session
from flowcredit.tasks.prompt_sets import load_prompt_set
from flowcredit.train import train
from flowcredit.validation import validate

BLUE = (0, 0, 255)


def fake_grid(title: str, strict: list[float]) -> Image.Image:
    """2 prompts × 2 blue 8×8 samples, scaled ×3 (24 px cells)."""
    images = torch.zeros(4, 3, 8, 8)
    images[:, 2] = 1.0
    soft = [0.25, 0.5, 0.75, 1.0]
    return scored_grid(images, ["two red circles", "a blue square"], soft, strict, title)


def colours(image: Image.Image, box: tuple[int, int, int, int]) -> set[tuple[int, ...]]:
    return {tuple(int(c) for c in px) for px in np.asarray(image.crop(box)).reshape(-1, 3)}


def test_scored_grid_frames_each_sample_by_pass_and_prints_its_score():
    grid = fake_grid("end", [1.0, 0.0, 0.0, 1.0])
    pad, text_h, label_h, cell = 4, 14, 12, 24
    row_h = cell + pad + text_h + label_h
    assert grid.size == (2 * (cell + pad) + pad, text_h + 2 * row_h + pad)
    for i, want in enumerate([PASS, FAIL, FAIL, PASS]):
        r, c = divmod(i, 2)
        x, y = pad + c * (cell + pad), text_h + pad + r * row_h + text_h
        assert grid.getpixel((x - 1, y + cell // 2)) == want  # the frame's left edge
        assert grid.getpixel((x + cell // 2, y + cell // 2)) == BLUE  # the sample itself
        ink = colours(grid, (x, y + cell + 1, x + cell, y + cell + label_h)) - {(255, 255, 255)}
        assert ink and all((g > r) == (want == PASS) for r, g, _ in ink)  # its score, in its colour
    assert len(colours(grid, (0, 0, grid.width, text_h))) > 1  # the title line is written
    wide = fake_grid("after training, test prompts: soft 0.625, strict 0.500 (16 prompts x 2)", [1.0] * 4)
    assert wide.width > 200 and wide.height == grid.height  # a long title widens a narrow grid


def test_scored_grid_without_pass_fail_has_black_scores_and_no_frames():
    grid = fake_grid("mean reward 0.6", [float("nan")] * 4)
    x, y = 4, 14 + 4 + 14
    assert grid.getpixel((x - 1, y + 12)) == (255, 255, 255)
    assert PASS not in colours(grid, (0, 0, grid.width, grid.height))


def test_before_after_puts_the_start_grid_left_of_the_end_grid(tmp_path):
    start, end = fake_grid("before", [0.0] * 4), fake_grid("after", [1.0] * 4)
    assert before_after(tmp_path, "test", end) is None  # no start grid: no pair
    start.save(tmp_path / "grid_start_test.png")
    pair = Image.open(before_after(tmp_path, "test", end))
    assert pair.size == (2 * start.width + 12, start.height)
    assert np.array_equal(np.asarray(pair.crop((0, 0, start.width, start.height))), np.asarray(start))
    right = pair.crop((start.width + 12, 0, pair.width, pair.height))
    assert np.array_equal(np.asarray(right), np.asarray(end))
    assert pair.getpixel((start.width + 6, 10)) == (160, 160, 160)  # the rule between the two


def test_evaluate_shows_a_labelled_bar_that_ends_at_100_percent(capsys):
    from flowcredit.models.tiny import load_builtin

    model = load_builtin()
    metas = load_prompt_set("test", 2, True)
    evaluate(model, metas, seed=3, samples_per_prompt=2, num_steps=2)
    err = capsys.readouterr().err
    assert "eval seed 3: scoring" in err and "100%" in err and "4/4" in err
    evaluate(model, metas, seed=3, samples_per_prompt=2, num_steps=2, progress=False)
    assert capsys.readouterr().err == ""


def test_calibration_shows_a_bar_over_its_rounds(tmp_path, capsys):
    s = build_session(
        small_config(
            "dense_grpo", tmp_path / "run", calib_max_iters=2, calib_flips=99, group_size=4, num_steps=4
        )
    )
    calibrate_psi(s)
    out = capsys.readouterr()
    assert "calibrate psi" in out.err and "100%" in out.err and "2/2" in out.err
    assert "calibrate: round 2" in out.out  # the per-round lines stay on stdout


def test_a_run_pairs_its_grids_and_eval_reproduces_its_score(tmp_path, capsys):
    """The demo recipe at test size: the end writes the before/after image, and the ``flowcredit eval``
    command the demo prints scores the final weights exactly as the run's last evaluation did."""
    fields = {**SMALL_RUN, "iterations": 1, "num_steps": 4, "window_size": 2, "group_size": 4}
    fields |= {"num_train_prompts": 2, "log_with": "none", "run_dir": str(tmp_path / "run")}
    cfg = validate(from_dict(fields, PRESETS["demo"]()))
    summary = train(cfg)
    run = tmp_path / "run"
    start, after = Image.open(run / "grid_start_test.png"), Image.open(run / "grid_after_test.png")
    pair = Image.open(run / "grid_before_after_test.png")
    assert pair.size == (start.width + 12 + after.width, max(start.height, after.height))
    assert (run / "grid_before_after_train.png").is_file()  # 4 training prompts: evaluated too
    found = colours(pair, (0, 0, pair.width, pair.height))
    assert PASS in found or FAIL in found
    lines = afterword(cfg).splitlines()
    assert "grid_before_after_test.png" in lines[0]
    argv = lines[-1].split("flowcredit eval ", 1)[1].split()
    assert main_eval([*argv, "--threads", "2", "--out", str(tmp_path / "eval")]) == 0
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    table = result["tables"][str(cfg.eval_seed)]
    assert table["overall"]["soft"] == pytest.approx(summary["test"]["after"], abs=1e-9)
    assert "100%" in capsys.readouterr().err
