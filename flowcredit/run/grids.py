"""Image grids of evaluation samples: captioned rows, pass/fail frames, per-sample scores, and a run's
before/after pair (the start's grid and the end's side by side)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

PASS, FAIL = (40, 170, 60), (210, 50, 50)
"""Frame (and score) colours of a sample whose strict score is 1 (pass) or not (fail)."""


def frame_strip(clips: torch.Tensor, max_frames: int = 8) -> torch.Tensor:
    """Video clips ``(B, F, 3, H, W)`` → one image per clip, ``min(F, max_frames)`` frames evenly spread
    from the first to the last, side by side: ``(B, 3, H, F'·W)``. Images ``(B, 3, H, W)`` pass
    through unchanged."""
    if clips.ndim == 4:
        return clips
    f = clips.shape[1]
    picks = torch.linspace(0, f - 1, min(f, max_frames)).round().long().unique()  # (F',)
    return torch.cat(clips[:, picks].unbind(dim=1), dim=-1)


def image_grid(
    images: torch.Tensor,
    captions: list[str],
    ncols: int,
    scale: int = 3,
    marks: list[float] | None = None,
    labels: list[str] | None = None,
    title: str | None = None,
) -> Image.Image:
    """Rows of ``ncols`` images, each row headed by its caption; optional green/red frame per image,
    a text under each image and a title line on top.

    Args:
        images: ``(R·ncols, 3, H, W)`` in [0, 1], or video clips ``(R·ncols, F, 3, H, W)`` (each shown as
            a strip of its frames, :func:`frame_strip`); captions: ``R`` strings; marks: ``R·ncols``
            values, 1 → green frame (strict pass), 0 → red; labels: ``R·ncols`` strings written under
            the images (e.g. their scores; green/red as the frame when ``marks`` is given).
        scale: pixel zoom of small images; never past 128 px of height (large images are shown at 1).
    """
    images = frame_strip(images)
    n, _, H, W = images.shape
    scale = max(1, min(scale, 128 // H))
    rows, pad, text_h = len(captions), 4, 14
    label_h, title_h = (12 if labels is not None else 0), (text_h if title else 0)
    cell_h, cell_w = H * scale, W * scale
    row_h = cell_h + pad + text_h + label_h
    width = ncols * (cell_w + pad) + pad
    if title:  # a narrow grid widens to show its whole title
        width = max(width, math.ceil(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(title)) + 2 * pad)
    size = (width, title_h + rows * row_h + pad)
    grid = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(grid)
    if title:
        draw.text((pad, pad), title, fill="black")
    pixels = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for i in range(min(n, rows * ncols)):
        r, c = divmod(i, ncols)
        x, y = pad + c * (cell_w + pad), title_h + pad + r * row_h + text_h
        if c == 0:
            draw.text((pad, y - text_h + 1), captions[r], fill="black")
        tile = Image.fromarray(pixels[i]).resize((cell_w, cell_h), Image.NEAREST)
        grid.paste(tile, (x, y))
        color = None if marks is None else (PASS if marks[i] >= 1.0 else FAIL)
        if color is not None:  # 1 px; 2 px in a scored grid, whose frames are the point
            w = 1 if labels is None else 2
            draw.rectangle([x - w, y - w, x + cell_w + w - 1, y + cell_h + w - 1], outline=color, width=w)
        if labels is not None:
            draw.text((x, y + cell_h + 1), labels[i], fill=color or "black")
    return grid


def scored_grid(
    images: torch.Tensor, captions: list[str], soft: list[float], strict: list[float], title: str
) -> Image.Image:
    """:func:`image_grid` of ``len(captions)`` rows with each sample's soft score under it and, when
    ``strict`` holds pass/fail values (not NaN), its green (pass) or red (fail) frame."""
    marks = None if any(math.isnan(m) for m in strict) else strict
    labels = [f"{v:.2f}" for v in soft]
    return image_grid(images, captions, len(soft) // len(captions), marks=marks, labels=labels, title=title)


def side_by_side(left: Image.Image, right: Image.Image, gap: int = 12) -> Image.Image:
    """``left`` and ``right`` on one white canvas, top-aligned, with a grey rule in the ``gap``."""
    out = Image.new("RGB", (left.width + gap + right.width, max(left.height, right.height)), "white")
    out.paste(left, (0, 0))
    out.paste(right, (left.width + gap, 0))
    rule = left.width + gap // 2
    ImageDraw.Draw(out).line([(rule, 0), (rule, out.height)], fill=(160, 160, 160))
    return out


def before_after(run_dir: Path, name: str, after: Image.Image) -> Path | None:
    """Write ``run_dir/grid_before_after_<name>.png``: the start's grid of set ``name``
    (``grid_start_<name>.png``, the same prompts and initial noise) left of ``after``. Returns its path,
    or None when the run has no start grid (evaluated at the start by another version or not at all)."""
    start = run_dir / f"grid_start_{name}.png"
    if not start.is_file():
        return None
    with Image.open(start) as before:
        pair = side_by_side(before.convert("RGB"), after)
    path = run_dir / f"grid_before_after_{name}.png"
    pair.save(path)
    return path
