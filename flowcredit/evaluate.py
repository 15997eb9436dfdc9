"""ODE sampling and ShapeEval evaluation (``flowcredit eval`` and ``flowcredit sample``).

Evaluation draws its initial noise from a ``torch.Generator`` seeded with ``seed``, so two evaluations
of one checkpoint agree exactly, and a checkpoint before and after training is compared on the same
noise. Several seeds measure the evaluation noise floor: differences smaller than the spread across
seeds are not learning.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from flowcredit.models.protocol import FlowModel
from flowcredit.schedule import sigmas as make_sigmas
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
        prompts: ``B`` captions. noise: ``(B, C, H, W)`` initial states x_0.
        num_steps, shift, guidance_scale: default to the model's ``num_steps``, ``shift`` and
            ``guidance_scale`` attributes (10, 1.0 and the current scale if it has none).
    Returns:
        images ``(B, 3, H, W)`` float32 in [0, 1].
    """
    num_steps = num_steps or getattr(model, "num_steps", 10)
    shift = shift if shift is not None else getattr(model, "shift", 1.0)
    sig = model.sigmas(num_steps) if hasattr(model, "sigmas") else make_sigmas(num_steps, shift)  # (N + 1,)
    ode = SAMPLERS["ode"]
    saved = model.guidance_scale
    if guidance_scale is not None:
        model.guidance_scale = float(guidance_scale)
    try:
        out = []
        for start in range(0, len(prompts), chunk):
            cond = model.encode(list(prompts[start : start + chunk]))
            x = noise[start : start + chunk].float()  # (b, C, H, W)
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
    rows = [m for m in metas for _ in range(samples_per_prompt)]
    prompts = [m["prompt"] for m in rows]
    noise = initial_noise(len(rows), tuple(model.latent_shape), seed).to(_device(model))
    images = sample(model, prompts, noise, num_steps, shift, guidance_scale, chunk)
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


def image_grid(
    images: torch.Tensor, captions: list[str], ncols: int, scale: int = 3, marks: list[float] | None = None
) -> Image.Image:
    """Rows of ``ncols`` images, each row headed by its caption; optional green/red frame per image.

    Args:
        images: ``(R·ncols, 3, H, W)`` in [0, 1]; captions: ``R`` strings; marks: ``R·ncols`` values,
            1 → green frame (strict pass), 0 → red.
    """
    n, _, H, W = images.shape
    rows, cell, pad, text_h = len(captions), H * scale, 4, 14
    grid = Image.new("RGB", (ncols * (cell + pad) + pad, rows * (cell + pad + text_h) + pad), "white")
    draw = ImageDraw.Draw(grid)
    pixels = (images.clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    for i in range(min(n, rows * ncols)):
        r, c = divmod(i, ncols)
        x, y = pad + c * (cell + pad), pad + r * (cell + pad + text_h) + text_h
        if c == 0:
            draw.text((pad, y - text_h + 1), captions[r], fill="black")
        tile = Image.fromarray(pixels[i]).resize((cell, cell), Image.NEAREST)
        grid.paste(tile, (x, y))
        if marks is not None:
            color = (40, 170, 60) if marks[i] >= 1.0 else (210, 50, 50)
            draw.rectangle([x - 1, y - 1, x + cell, y + cell], outline=color)
    return grid


def load_metas(spec: str) -> list[dict]:
    """``"test"`` / ``"train"`` (the shipped splits) or a JSONL file of ShapeEval metadata."""
    if spec in ("test", "train"):
        return shapes.load_prompts(spec)
    metas = [json.loads(line) for line in Path(spec).read_text().splitlines() if line.strip()]
    for m in metas:
        shapes.validate_meta(m)
    return metas


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default="builtin", help="checkpoint directory or 'builtin' (default)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the checkpoint's)")
    p.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the checkpoint's)")
    p.add_argument("--shift", type=float, default=None, help="schedule shift (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")


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
    image_grid(run["images"][rows], captions, k, marks=[run["strict"][i] for i in rows.tolist()]).save(
        out / "grid.png"
    )
    print(f"\nwrote {out / 'eval.json'} and {out / 'grid.png'}")


def _eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flowcredit eval", description=main_eval.__doc__)
    _common_args(p)
    p.add_argument("--prompts", default="test", help="'test' (default), 'train' or a JSONL metadata file")
    p.add_argument("--seeds", default="0", help="comma-separated noise seeds, e.g. 0,1,2")
    p.add_argument("--samples-per-prompt", type=int, default=4)
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--out", default=None, help="directory for eval.json and grid.png")
    p.add_argument("--grid-prompts", type=int, default=12, help="prompts shown in grid.png")
    return p


def main_eval(argv: list[str] | None = None) -> int:
    """``flowcredit eval``: per-category ShapeEval table, noise floor across seeds, grid PNG and JSON."""
    from flowcredit.models.tiny import load_checkpoint

    args = _eval_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint)
    metas = load_metas(args.prompts)[: args.max_prompts]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    settings, k = _settings(model, args), args.samples_per_prompt
    steps, shift, cfg = settings["steps"], settings["shift"], settings["cfg"]
    runs = [
        evaluate(model, metas, seed, k, steps, shift, cfg, return_images=i == 0)
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
    from flowcredit.models.tiny import load_checkpoint

    p = argparse.ArgumentParser(prog="flowcredit sample", description=main_sample.__doc__)
    _common_args(p)
    p.add_argument("--prompt", required=True, help='e.g. "two red circles"')
    p.add_argument("--n", type=int, default=8, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--out", required=True, help="PNG file to write")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_checkpoint(args.checkpoint)
    settings = _settings(model, args)
    noise = initial_noise(args.n, tuple(model.latent_shape), args.seed)
    try:
        images = sample(
            model, [args.prompt] * args.n, noise, settings["steps"], settings["shift"], settings["cfg"]
        )
    except ValueError as e:
        print(f"flowcredit sample: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, [args.prompt], args.n, scale=4).save(out)
    print(f"wrote {out} ({args.n} samples, {settings['steps']} steps, cfg {settings['cfg']})")
    return 0
