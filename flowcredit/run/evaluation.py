"""ODE sampling and evaluation with fixed noise: of a model (``flowcredit eval`` / ``sample``) and of
a training run's policy (:func:`evaluate_policy`).

Evaluation draws its initial noise from a ``torch.Generator`` seeded with ``seed``, so two evaluations
of one checkpoint agree exactly, and a checkpoint before and after training is compared on the same
noise. Several seeds measure the evaluation noise floor: differences smaller than the spread across
seeds are not learning.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
from PIL import Image, ImageDraw

from flowcredit.models.protocol import FlowModel
from flowcredit.rewards import tabulator, uses_shapeeval
from flowcredit.sde import SAMPLERS
from flowcredit.tasks import shapes


@torch.no_grad()
def sample(
    model: FlowModel,
    prompts: list[str],
    noise: torch.Tensor,
    num_steps: int | None = None,
    shift: float | None = None,
    guidance_scale: float | None = None,
    chunk: int = 128,
) -> torch.Tensor:
    """Euler ODE sampling from ``noise`` (σ = 1) to images, in chunks of ``chunk`` prompts.

    Args:
        prompts: ``B`` captions. noise: ``(B, *latent_shape)`` initial states x_0 (a video model's:
            ``(B, C, F, H, W)``).
        num_steps, shift, guidance_scale: default to the model's ``num_steps``, ``shift`` and
            ``guidance_scale``.
    Returns:
        ``model.decode``'s output: images ``(B, 3, H, W)`` or clips ``(B, F, 3, H, W)``, float32 in [0, 1].
    """
    num_steps = num_steps or model.num_steps
    shift = shift if shift is not None else model.shift
    sig = model.sigmas(num_steps, shift)  # (N + 1,)
    ode = SAMPLERS["ode"]
    saved = model.guidance_scale
    if guidance_scale is not None:
        model.guidance_scale = float(guidance_scale)
    try:
        out = []
        for start in range(0, len(prompts), chunk):
            cond = model.encode(list(prompts[start : start + chunk]))
            x = noise[start : start + chunk].float()  # (b, *latent_shape)
            for i in range(num_steps):
                sigma = sig[i].expand(x.shape[0])  # (b,)
                x = ode(model.velocity(x, sigma, cond), x, sigma, sig[i + 1].expand(x.shape[0])).x_next
            out.append(model.decode(x).cpu())
    finally:
        model.guidance_scale = saved
    return torch.cat(out)


def initial_noise(n: int, latent_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """``(n, *latent_shape)`` standard normal from a CPU generator seeded with ``seed``."""
    return torch.randn((n, *latent_shape), generator=torch.Generator().manual_seed(seed))


def sample_prompts(model, metas, seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk):
    """``samples_per_prompt`` ODE samples of every prompt of ``metas`` (prompt-major), initial noise from
    ``seed``: ``(rows: metas per sample, prompts, images (P·k, 3, H, W))``."""
    rows = [m for m in metas for _ in range(samples_per_prompt)]
    prompts = [m["prompt"] for m in rows]
    noise = initial_noise(len(rows), tuple(model.latent_shape), seed).to(_device(model))
    return rows, prompts, sample(model, prompts, noise, num_steps, shift, guidance_scale, chunk)


def evaluate(
    model: FlowModel,
    metas: list[dict],
    seed: int = 0,
    samples_per_prompt: int = 4,
    num_steps: int | None = None,
    shift: float | None = None,
    guidance_scale: float | None = None,
    chunk: int = 128,
    return_images: bool = False,
) -> dict:
    """ShapeEval of ``model`` on prompts ``metas`` with fixed initial noise.

    Every prompt is sampled ``samples_per_prompt`` times (prompt-major order).
    Returns:
        ``{"table": evaluation_table (per category + "overall", soft and strict), "prompts": [str],
        "soft": [float], "strict": [float]}`` and ``"images" (P·k, 3, H, W)`` if ``return_images``.
    """
    rows, prompts, images = sample_prompts(
        model, metas, seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk
    )
    scores = shapes.score_images(images, rows)
    out = {
        "table": shapes.evaluation_table(scores["soft"], scores["strict"], scores["category"]),
        "prompts": prompts,
        "soft": scores["soft"].tolist(),
        "strict": scores["strict"].tolist(),
    }
    if return_images:
        out["images"] = images
    return out


def evaluate_reward(
    model: FlowModel,
    metas: list[dict],
    reward,
    seed: int = 0,
    samples_per_prompt: int = 4,
    num_steps: int | None = None,
    shift: float | None = None,
    guidance_scale: float | None = None,
    chunk: int = 128,
    return_images: bool = False,
) -> dict:
    """:func:`evaluate` for any reward ``reward(images, prompts, metas) -> (M,)`` (a registry reward, a
    mix, ``pkg.mod:fn``): the same fixed noise and prompt-major order; the table has one row,
    ``overall`` (``soft`` = the mean reward; ``strict`` is NaN: no pass/fail), unless the reward has a
    per-tag table (``geneval``: per tag and overall, soft = partial, strict = GenEval's score)."""
    rows, prompts, images = sample_prompts(
        model, metas, seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk
    )
    tabulate = tabulator(reward)
    if tabulate is not None:  # a reward with a per-tag table (geneval): soft = its partial score
        scores = tabulate(images, prompts, rows)
        table = shapes.evaluation_table(scores["soft"], scores["strict"], scores["category"])
        out = {"table": table, "prompts": prompts, "soft": scores["soft"], "strict": scores["strict"]}
        return {**out, "images": images} if return_images else out
    scores = reward(images, prompts, rows)  # (P·k,)
    out = {
        "table": {"overall": {"n": len(rows), "soft": scores.mean().item(), "strict": math.nan}},
        "prompts": prompts,
        "soft": scores.tolist(),
        "strict": [math.nan] * len(rows),
    }
    return {**out, "images": images} if return_images else out


def _device(model: FlowModel) -> torch.device:
    return next(model.net.parameters()).device


def seed_summary(tables: list[dict]) -> dict:
    """Mean, std (ddof 0), min and max across seeds of every ``(category, soft|strict)`` entry."""
    out = {}
    for cat in tables[0]:
        out[cat] = {}
        for key in ("soft", "strict"):
            v = np.array([t[cat][key] for t in tables])
            out[cat][key] = {
                "mean": float(v.mean()),
                "std": float(v.std()),
                "min": float(v.min()),
                "max": float(v.max()),
            }
    return out


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
    images: torch.Tensor, captions: list[str], ncols: int, scale: int = 3, marks: list[float] | None = None
) -> Image.Image:
    """Rows of ``ncols`` images, each row headed by its caption; optional green/red frame per image.

    Args:
        images: ``(R·ncols, 3, H, W)`` in [0, 1], or video clips ``(R·ncols, F, 3, H, W)`` (each shown as
            a strip of its frames, :func:`frame_strip`); captions: ``R`` strings; marks: ``R·ncols``
            values, 1 → green frame (strict pass), 0 → red.
        scale: pixel zoom of small images; never past 128 px of height (large images are shown at 1).
    """
    images = frame_strip(images)
    n, _, H, W = images.shape
    scale = max(1, min(scale, 128 // H))
    rows, pad, text_h = len(captions), 4, 14
    cell_h, cell_w = H * scale, W * scale
    grid = Image.new("RGB", (ncols * (cell_w + pad) + pad, rows * (cell_h + pad + text_h) + pad), "white")
    draw = ImageDraw.Draw(grid)
    pixels = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for i in range(min(n, rows * ncols)):
        r, c = divmod(i, ncols)
        x, y = pad + c * (cell_w + pad), pad + r * (cell_h + pad + text_h) + text_h
        if c == 0:
            draw.text((pad, y - text_h + 1), captions[r], fill="black")
        tile = Image.fromarray(pixels[i]).resize((cell_w, cell_h), Image.NEAREST)
        grid.paste(tile, (x, y))
        if marks is not None:
            color = (40, 170, 60) if marks[i] >= 1.0 else (210, 50, 50)
            draw.rectangle([x - 1, y - 1, x + cell_w, y + cell_h], outline=color)
    return grid


def _eval_tables(s, metas: list[dict], seed: int, images: bool = False) -> dict:
    """ShapeEval tables (``shapes`` reward) or the mean evaluation reward (``eval_reward``, else the
    training one), ODE sampler with ``eval_num_steps`` / ``eval_guidance_scale`` (0: training's), fixed
    noise."""
    cfg, k = s.cfg, s.cfg.eval_samples_per_prompt
    steps, guidance = cfg.eval_num_steps or cfg.num_steps, cfg.eval_guidance_scale or None
    ema = s.ema.applied() if s.ema is not None else contextlib.nullcontext()
    with torch.no_grad(), ema, s.policy.merged():
        if uses_shapeeval(cfg.eval_reward or cfg.reward):
            return evaluate(
                s.model,
                metas,
                seed=seed,
                samples_per_prompt=k,
                num_steps=steps,
                shift=cfg.shift,
                guidance_scale=guidance,
                return_images=images,
            )
        reward = s.eval_reward or s.reward
        return evaluate_reward(
            s.model, metas, reward, seed, k, steps, cfg.shift, guidance, cfg.batch_size, images
        )


def evaluate_policy(s, tag: str | None, grids: dict | None = None) -> dict:
    """Held-out (and, with a small training set, trained-prompt) scores of a run's policy (a
    ``flowcredit.run.session.Session``) with the ODE sampler and fixed noise.

    ``tag`` names the image grids saved in the run directory (``grid_<tag>_<set>.png``); ``"start"``
    also measures the noise floor (std over 3 noise seeds), kept in ``s.history``. ``grids``, if
    given, receives each set's grid as ``{"eval/<set>": PIL image}`` (for a tracker), tag or not.
    """
    out = {}
    sets = {"test": s.eval_metas}
    if len(s.train_metas) <= 32:  # a small training set is evaluated too (did the trained prompts improve?)
        sets["train"] = s.train_metas
    for name, metas in sets.items():
        res = _eval_tables(s, metas, s.cfg.eval_seed, images=tag is not None or grids is not None)
        overall = res["table"]["overall"]
        out[f"eval/{name}/soft"] = overall["soft"]
        if not math.isnan(overall["strict"]):  # only ShapeEval has a pass/fail (NaN is not JSON)
            out[f"eval/{name}/strict"] = overall["strict"]
        for cat, row in res["table"].items():  # per ShapeEval category (held-out set only)
            if name == "test" and cat != "overall" and len(res["table"]) > 2:
                out[f"eval/test/{cat}/soft"], out[f"eval/test/{cat}/strict"] = row["soft"], row["strict"]
        if tag is not None or grids is not None:
            grid = _grid(s, res, metas)
            if tag is not None and s.dist.is_main:  # FSDP: every rank evaluates, rank 0 writes
                grid.save(s.run_dir / f"grid_{tag}_{name}.png")
            if grids is not None:
                grids[f"eval/{name}"] = grid
        if tag == "start":
            floors = [_eval_tables(s, metas, s.cfg.eval_seed + k)["table"]["overall"]["soft"] for k in (1, 2)]
            spread = torch.tensor([overall["soft"], *floors])
            s.history[f"floor/{name}/soft"] = spread.std(unbiased=False).item()
            out[f"eval/{name}/floor_soft"] = s.history[f"floor/{name}/soft"]
    return out


def _grid(s, res: dict, metas: list[dict]):
    """The first 8 prompts' samples of an evaluation as one captioned PIL image."""
    k = s.cfg.eval_samples_per_prompt
    n = min(len(metas), 8)
    rows = torch.tensor([i * k + j for i in range(n) for j in range(k)])
    return image_grid(res["images"][rows], [m["prompt"] for m in metas[:n]], k)
