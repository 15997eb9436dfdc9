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
from tqdm import tqdm

from flowcredit.models.protocol import FlowModel, guidance_at
from flowcredit.rewards import tabulator, uses_shapeeval
from flowcredit.run.grids import before_after, scored_grid
from flowcredit.run.grids import frame_strip as frame_strip  # re-exported: its home was this module
from flowcredit.run.grids import image_grid as image_grid
from flowcredit.run.progress import progress_bar
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
    bar: tqdm | None = None,
) -> torch.Tensor:
    """Euler ODE sampling from ``noise`` (σ = 1) to images, in chunks of ``chunk`` prompts.

    Args:
        prompts: ``B`` captions. noise: ``(B, *latent_shape)`` initial states x_0 (a video model's:
            ``(B, C, F, H, W)``).
        num_steps, shift, guidance_scale: default to the model's ``num_steps``, ``shift`` and
            ``guidance_scale``.
        bar: a progress bar advanced by each chunk's samples (:func:`flowcredit.run.progress.progress_bar`).
    Returns:
        ``model.decode``'s output: images ``(B, 3, H, W)`` or clips ``(B, F, 3, H, W)``, float32 in [0, 1].
    """
    num_steps = num_steps or model.num_steps
    shift = shift if shift is not None else model.shift
    sig = model.sigmas(num_steps, shift)  # (N + 1,)
    ode = SAMPLERS["ode"]
    with guidance_at(model, guidance_scale):
        out = []
        for start in range(0, len(prompts), chunk):
            cond = model.encode(list(prompts[start : start + chunk]))
            x = noise[start : start + chunk].float()  # (b, *latent_shape)
            for i in range(num_steps):
                sigma = sig[i].expand(x.shape[0])  # (b,)
                x = ode(model.velocity(x, sigma, cond), x, sigma, sig[i + 1].expand(x.shape[0])).x_next
            out.append(model.decode(x).cpu())
            if bar is not None:
                bar.update(x.shape[0])
    return torch.cat(out)


def initial_noise(n: int, latent_shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """``(n, *latent_shape)`` standard normal from a CPU generator seeded with ``seed``."""
    return torch.randn((n, *latent_shape), generator=torch.Generator().manual_seed(seed))


def sample_prompts(model, metas, seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk, bar=None):
    """``samples_per_prompt`` ODE samples of every prompt of ``metas`` (prompt-major), initial noise from
    ``seed``: ``(rows: metas per sample, prompts, images (P·k, 3, H, W))``; ``bar`` counts the samples."""
    rows = [m for m in metas for _ in range(samples_per_prompt)]
    prompts = [m["prompt"] for m in rows]
    noise = initial_noise(len(rows), tuple(model.latent_shape), seed).to(_device(model))
    return rows, prompts, sample(model, prompts, noise, num_steps, shift, guidance_scale, chunk, bar)


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
    progress: bool | str = True,
) -> dict:
    """ShapeEval of ``model`` on prompts ``metas`` with fixed initial noise.

    Every prompt is sampled ``samples_per_prompt`` times (prompt-major order). ``progress``: a
    progress bar on stderr over the samples, labelled ``eval seed <seed>`` (True) or with the string
    given; False: none.
    Returns:
        ``{"table": evaluation_table (per category + "overall", soft and strict), "prompts": [str],
        "soft": [float], "strict": [float]}`` and ``"images" (P·k, 3, H, W)`` if ``return_images``.
    """

    def score(images, prompts, rows):
        scores = shapes.score_images(images, rows)
        return {
            "table": shapes.evaluation_table(scores["soft"], scores["strict"], scores["category"]),
            "prompts": prompts,
            "soft": scores["soft"].tolist(),
            "strict": scores["strict"].tolist(),
        }

    settings = (seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk)
    return _sampled_and_scored(model, metas, settings, score, return_images, progress)


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
    progress: bool | str = True,
) -> dict:
    """:func:`evaluate` for any reward ``reward(images, prompts, metas) -> (M,)`` (a registry reward, a
    mix, ``pkg.mod:fn``): the same fixed noise and prompt-major order; the table has one row,
    ``overall`` (``soft`` = the mean reward; ``strict`` is NaN: no pass/fail), unless the reward has a
    per-tag table (``geneval``: per tag and overall, soft = partial, strict = GenEval's score)."""
    tabulate = tabulator(reward)

    def score(images, prompts, rows):
        if tabulate is not None:  # a reward with a per-tag table (geneval): soft = its partial score
            scores = tabulate(images, prompts, rows)
            table = shapes.evaluation_table(scores["soft"], scores["strict"], scores["category"])
            return {"table": table, "prompts": prompts, "soft": scores["soft"], "strict": scores["strict"]}
        scores = reward(images, prompts, rows)  # (P·k,)
        return {
            "table": {"overall": {"n": len(rows), "soft": scores.mean().item(), "strict": math.nan}},
            "prompts": prompts,
            "soft": scores.tolist(),
            "strict": [math.nan] * len(rows),
        }

    settings = (seed, samples_per_prompt, num_steps, shift, guidance_scale, chunk)
    return _sampled_and_scored(model, metas, settings, score, return_images, progress)


def _sampled_and_scored(model, metas, settings: tuple, score, return_images: bool, progress: bool | str):
    """Sample every prompt of ``metas`` (``settings``: seed, samples per prompt, steps, shift, guidance,
    chunk), then ``score(images, prompts, rows) -> dict``; with ``progress``, a bar over the samples
    that says when the scoring runs."""
    seed, k, steps, shift, guidance, chunk = settings
    label = progress if isinstance(progress, str) else f"eval seed {seed}"
    with progress_bar(len(metas) * k, label, "sample", enabled=bool(progress)) as bar:
        rows, prompts, images = sample_prompts(model, metas, seed, k, steps, shift, guidance, chunk, bar)
        bar.set_description(f"{label}: scoring", refresh=True)
        out = score(images, prompts, rows)
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
                progress=False,  # the training bar is on the screen
            )
        reward = s.eval_reward or s.reward
        return evaluate_reward(
            s.model, metas, reward, seed, k, steps, cfg.shift, guidance, cfg.batch_size, images, False
        )


def evaluate_policy(s, tag: str | None, grids: dict | None = None) -> dict:
    """Held-out (and, with a small training set, trained-prompt) scores of a run's policy (a
    ``flowcredit.run.session.Session``) with the ODE sampler and fixed noise.

    ``tag`` names the image grids saved in the run directory (``grid_<tag>_<set>.png``); ``"start"``
    also measures the noise floor (std over 3 noise seeds), kept in ``s.history``; ``"after"`` (the
    end of the run) also writes ``grid_before_after_<set>.png``, the start's grid beside the end's.
    ``grids``, if given, receives each set's grid as ``{"eval/<set>": PIL image}`` (for a tracker), tag
    or not. Each grid frames a sample green (strict pass) or red and prints its soft score under it.
    """
    out = {}
    sets = {"test": s.eval_metas}
    if len(s.train_metas) <= 32:  # a small training set is evaluated too (did the trained prompts improve?)
        sets["train"] = s.train_metas
    guard = getattr(s, "guard", None)
    for name, metas in sets.items():
        guarded = guard is not None and name == "test"  # the guard measures the held-out samples
        res = _eval_tables(s, metas, s.cfg.eval_seed, images=tag is not None or grids is not None or guarded)
        overall = res["table"]["overall"]
        out[f"eval/{name}/soft"] = overall["soft"]
        if not math.isnan(overall["strict"]):  # only ShapeEval has a pass/fail (NaN is not JSON)
            out[f"eval/{name}/strict"] = overall["strict"]
        for cat, row in res["table"].items():  # per ShapeEval category (held-out set only)
            if name == "test" and cat != "overall" and len(res["table"]) > 2:
                out[f"eval/test/{cat}/soft"], out[f"eval/test/{cat}/strict"] = row["soft"], row["strict"]
        if tag is not None or grids is not None:
            _save_grid(s, tag, name, res, metas, grids)
        others = []  # at the start: the other two noise seeds' evaluations (the noise floor)
        if tag == "start":
            others = [_eval_tables(s, metas, s.cfg.eval_seed + k, images=guarded) for k in (1, 2)]
            spread = torch.tensor([overall["soft"], *(o["table"]["overall"]["soft"] for o in others)])
            s.history[f"floor/{name}/soft"] = spread.std(unbiased=False).item()
            out[f"eval/{name}/floor_soft"] = s.history[f"floor/{name}/soft"]
        if guarded:
            out |= guard.measure(s, res["images"], metas, [o["images"] for o in others])
    return out


GRID_PROMPTS = 8
"""Prompts (the set's first) shown in a run's evaluation grids."""

WHEN = {"start": "before training", "after": "after training"}
"""The title of a grid by its tag (other tags and none: "during training")."""


def _save_grid(s, tag: str | None, name: str, res: dict, metas: list[dict], grids: dict | None) -> None:
    """The grid of set ``name``'s evaluation ``res``: ``grid_<tag>_<name>.png`` (rank 0; and at
    ``"after"`` the before/after pair), and into ``grids`` for a tracker."""
    grid = _grid(s, res, metas, f"{WHEN.get(tag, 'during training')}, {name} prompts")
    if tag is not None and s.dist.is_main:  # FSDP: every rank evaluates, rank 0 writes
        grid.save(s.run_dir / f"grid_{tag}_{name}.png")
        if tag == "after":
            before_after(s.run_dir, name, grid)
    if grids is not None:
        grids[f"eval/{name}"] = grid


def _grid(s, res: dict, metas: list[dict], when: str):
    """The first :data:`GRID_PROMPTS` prompts' samples of an evaluation as one captioned PIL image, its
    title ``when`` with the set's scores."""
    k = s.cfg.eval_samples_per_prompt
    n = min(len(metas), GRID_PROMPTS)
    rows = [i * k + j for i in range(n) for j in range(k)]
    overall = res["table"]["overall"]
    score = "soft" if uses_shapeeval(s.cfg.eval_reward or s.cfg.reward) else "mean reward"
    title = f"{when}: {score} {overall['soft']:.3f}"
    if not math.isnan(overall["strict"]):
        title += f", strict {overall['strict']:.3f}"
    title += f" ({len(metas)} prompts x {k}, first {n} shown)"
    soft, strict = [res["soft"][i] for i in rows], [res["strict"][i] for i in rows]
    captions = [m["prompt"] for m in metas[:n]]
    return scored_grid(res["images"][torch.tensor(rows)], captions, soft, strict, title)
