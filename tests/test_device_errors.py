"""``--device cuda`` where torch has no CUDA: one line naming ``device`` and how to get a CUDA build,
exit 2 (issue 58, item 1: it was torch's 51-line traceback)."""

from __future__ import annotations

import pytest
import torch

from flowcredit.cli import main


@pytest.mark.parametrize("command", ["sample", "train", "eval"])
def test_cuda_on_a_cpu_torch_is_one_line(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)  # the CPU wheel
    argv = {
        "sample": ["--prompt", "a red circle", "--out", str(tmp_path / "x.png")],
        "train": ["--preset", "demo", "--iterations", "1", "--run_dir", str(tmp_path / "run")],
        "eval": ["--max-prompts", "1", "--samples-per-prompt", "1"],
    }[command]
    assert main([command, "--device", "cuda", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "device" in err and "'cuda'" in err
    assert "has no CUDA" in err and "--index-url https://download.pytorch.org/whl/" in err


def test_cuda_torch_without_a_gpu_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build on a machine without a GPU
    assert main(["sample", "--device", "cuda:1", "--prompt", "x", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "'cuda:1'" in err and "finds no CUDA GPU" in err and "index-url" not in err
