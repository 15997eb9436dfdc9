"""``flowcredit eval`` and ``flowcredit sample``: ODE samples of any adapter (``--model``), scored on
ShapeEval prompts (``--reward shapes``, per-category table) or with any reward on any prompt file, or
saved as a grid."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

from flowcredit.config import Config, validate
from flowcredit.models import load_model
from flowcredit.rewards import get_reward
from flowcredit.run.evaluation import (
    evaluate,
    evaluate_reward,
    image_grid,
    initial_noise,
    sample,
    seed_summary,
)
from flowcredit.tasks import shapes
from flowcredit.tasks.prompt_sets import read_prompts


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="adapter: tiny (default), sd3, flux or pkg.mod:load")
    p.add_argument(
        "--checkpoint", default="builtin", help="weights: 'builtin' (tiny), a directory or a diffusers hub id"
    )
    p.add_argument("--resolution", type=int, default=0, help="image size of diffusers models (0: default)")
    p.add_argument("--dtype", default="auto", help="weights dtype of diffusers models")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the checkpoint's)")
    p.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the checkpoint's)")
    p.add_argument("--shift", type=float, default=None, help="schedule shift (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")


def load_model_from_args(args):
    """The adapter ``--model`` with ``--checkpoint`` weights (built as the trainer builds it)."""
    cfg = validate(
        Config(model=args.model, checkpoint=args.checkpoint, resolution=args.resolution, dtype=args.dtype)
    )
    return load_model(cfg)


def _settings(model, args) -> dict:
    return {
        "checkpoint": str(args.checkpoint),
        "steps": args.steps or model.num_steps,
        "cfg": model.guidance_scale if args.cfg is None else args.cfg,
        "shift": model.shift if args.shift is None else args.shift,
    }


def _format_summary(summary: dict, n: dict) -> str:
    lines = [f"{'category':<14}{'n':>6}{'soft (mean ± std)':>22}{'strict (mean ± std)':>24}"]
    for cat, r in summary.items():
        s, t = r["soft"], r["strict"]
        lines.append(
            f"{cat:<14}{n[cat]:>6d}{s['mean']:>14.3f} ± {s['std']:.3f}{t['mean']:>16.3f} ± {t['std']:.3f}"
        )
    return "\n".join(lines)


def _write_eval_outputs(out: Path, result: dict, run: dict, metas: list[dict], k: int, n_grid: int) -> None:
    """``eval.json`` (all numbers) and ``grid.png`` (``n_grid`` prompts spread over the list, first seed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    picks = np.unique(np.linspace(0, len(metas) - 1, min(n_grid, len(metas))).round()).astype(int)
    rows = torch.tensor([i * k + j for i in picks for j in range(k)])
    captions = [metas[i]["prompt"] for i in picks]
    marks = [run["strict"][i] for i in rows.tolist()]
    marks = None if any(m != m for m in marks) else marks  # NaN: no pass/fail frames (non-ShapeEval reward)
    image_grid(run["images"][rows], captions, k, marks=marks).save(out / "grid.png")
    print(f"\nwrote {out / 'eval.json'} and {out / 'grid.png'}")


def _eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowcredit eval", description=main_eval.__doc__)
    _common_args(p)
    p.add_argument(
        "--prompts", default="test", help="'test' (default), 'train', a JSONL file or a text file of prompts"
    )
    p.add_argument("--reward", default="shapes", help="shapes (the ShapeEval table), any reward or a mix")
    p.add_argument("--reward_options", default="", help="JSON of per-reward options, as the trainer's")
    p.add_argument("--seeds", default="0", help="comma-separated noise seeds, e.g. 0,1,2")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--out", default=None, help="directory for eval.json and grid.png")
    p.add_argument("--grid-prompts", type=int, default=12, help="prompts shown in grid.png")
    return p


def main_eval(argv: list[str] | None = None) -> int:
    """``flowcredit eval``: per-category ShapeEval table (or the mean of any ``--reward``), noise floor
    across seeds, grid PNG and JSON."""
    args = _eval_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    shapes_eval = args.reward == "shapes"  # its per-category table needs ShapeEval metadata
    metas = read_prompts(args.prompts, shapes_metadata=shapes_eval)[: args.max_prompts]
    score = evaluate
    if not shapes_eval:
        options = json.loads(args.reward_options) if args.reward_options else None
        score = partial(evaluate_reward, reward=get_reward(args.reward, options))
    model = load_model_from_args(args)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    settings, k = _settings(model, args), args.samples_per_prompt
    steps, shift, cfg = settings["steps"], settings["shift"], settings["cfg"]
    runs = [
        score(
            model,
            metas,
            seed=seed,
            samples_per_prompt=k,
            num_steps=steps,
            shift=shift,
            guidance_scale=cfg,
            return_images=i == 0,
        )
        for i, seed in enumerate(seeds)
    ]
    print(
        f"{len(metas)} prompts x {k} samples, {steps} ODE steps, cfg {cfg}, shift {shift}, "
        f"checkpoint {settings['checkpoint']}"
    )
    for seed, run in zip(seeds, runs, strict=True):
        print(f"\nseed {seed}\n{shapes.format_table(run['table'])}")
    pairs = list(zip(map(str, seeds), runs, strict=True))
    result = {
        **settings,
        "reward": args.reward,
        "prompts": args.prompts,
        "samples_per_prompt": k,
        "seeds": seeds,
        "tables": {s: r["table"] for s, r in pairs},
        "per_sample": {s: {"soft": r["soft"], "strict": r["strict"]} for s, r in pairs},
        "sample_prompts": runs[0]["prompts"],
    }
    if len(seeds) > 1:
        result["across_seeds"] = seed_summary([r["table"] for r in runs])
        n = {cat: row["n"] for cat, row in runs[0]["table"].items()}
        print(
            f"\nacross {len(seeds)} seeds (the evaluation noise floor)\n"
            + _format_summary(result["across_seeds"], n)
        )
    if args.out:
        _write_eval_outputs(Path(args.out), result, runs[0], metas, k, args.grid_prompts)
    return 0


def main_sample(argv: list[str] | None = None) -> int:
    """``flowcredit sample``: a row of ``n`` ODE samples of one prompt, saved as a PNG."""
    p = argparse.ArgumentParser(prog="flowcredit sample", description=main_sample.__doc__)
    _common_args(p)
    p.add_argument("--prompt", required=True, help='e.g. "two red circles"')
    p.add_argument("--n", type=int, default=8, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--out", required=True, help="PNG file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model_from_args(args)
    settings = _settings(model, args)
    noise = initial_noise(args.n, tuple(model.latent_shape), args.seed).to(
        next(model.net.parameters()).device
    )
    images = sample(
        model, [args.prompt] * args.n, noise, settings["steps"], settings["shift"], settings["cfg"]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, [args.prompt], args.n, scale=4).save(out)
    print(f"wrote {out} ({args.n} samples, {settings['steps']} steps, cfg {settings['cfg']})")
    return 0
