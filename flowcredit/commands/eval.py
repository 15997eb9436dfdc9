"""``flowcredit eval`` and ``flowcredit sample``: ODE samples of any adapter (``--model``), scored on
ShapeEval prompts (``--reward shapes``, per-category table) or with any reward on any prompt file, or
saved as a grid (video clips as frame strips).

``--config FILE`` (YAML or JSON, e.g. a run's ``config.json``) takes the model settings and the
evaluation settings of a training config: ``model``, ``checkpoint``, ``resolution``, ``dtype``,
``num_frames``, ``shift``, ``reward_options``, ``reward_frame_stride``, and the steps, guidance and reward
of the run's own evaluation (``eval_num_steps`` / ``eval_guidance_scale`` / ``eval_reward``, each
falling back to the training value). A flag given on the command line wins."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import numpy as np
import torch

from flowcredit.cli_args import ArgParser
from flowcredit.config import Config, from_dict, read_mapping
from flowcredit.errors import UserError, reading
from flowcredit.models import load_model
from flowcredit.models.diffusers_checkpoint import is_run_final
from flowcredit.rewards import check_metadata, uses_shapeeval
from flowcredit.run.evaluation import (
    evaluate,
    evaluate_reward,
    image_grid,
    initial_noise,
    sample,
    seed_summary,
)
from flowcredit.run.policy import apply_trained
from flowcredit.run.session import build_reward
from flowcredit.tasks import shapes
from flowcredit.tasks.prompt_sets import load_prompt_set
from flowcredit.validation import validate


def _common_args(p: ArgParser) -> None:
    p.add_argument("--config", default=None, help="a YAML/JSON config (e.g. a run's config.json): defaults")
    p.add_argument(
        "--model",
        default=None,
        help="adapter: tiny (default), a name of flowcredit.models.MODELS, or pkg.mod:load",
    )
    p.add_argument(
        "--checkpoint", default=None, help="weights: 'builtin' (tiny), a directory or a diffusers hub id"
    )
    p.add_argument("--resolution", type=int, default=None, help="image size of diffusers models (0: default)")
    p.add_argument("--frames", type=int, default=None, help="frames of a video model's clip (0: default)")
    p.add_argument("--dtype", default=None, help="weights dtype of diffusers models (default auto)")
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:k]; with --config: the run's")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the checkpoint's)")
    p.add_argument("--cfg", type=float, default=None, help="guidance scale (default: the checkpoint's)")
    p.add_argument("--shift", type=float, default=None, help="schedule shift (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")


def run_final(args) -> Path | None:
    """The run's ``final/`` whose trained weights the command samples: ``--checkpoint RUN/final`` of
    a diffusers run (a LoRA or ``transformer/`` export, its base model named in ``RUN/config.json``),
    or ``RUN/final`` beside ``--config RUN/config.json`` when no ``--checkpoint`` is given."""
    if args.checkpoint is not None:
        trained = is_run_final(args.checkpoint) or _tensors_only(args.checkpoint)
        return Path(args.checkpoint) if trained else None
    if args.config:
        final = Path(args.config).parent / "final"
        if (final / "trainable.safetensors").is_file():
            return final
    return None


def _tensors_only(path: str | Path) -> bool:
    """A published run's weights (``benchmarks/results/*/runs/<run>/final`` or ``…/iteration-K``):
    ``trainable.safetensors`` alone, the run's ``config.json`` one level up."""
    path = Path(path)
    return (
        (path / "trainable.safetensors").is_file()
        and (path.parent / "config.json").is_file()
        and not any((path / name).exists() for name in ("model.safetensors", "transformer"))
        and not is_run_final(path)
    )


def config_from_args(args) -> tuple[Config, Path | None]:
    """``--config`` (or the defaults) with the model flags given on the command line, validated; and
    the run's ``final/`` to load on top of the base weights (:func:`run_final`; None: the checkpoint
    as is). ``--checkpoint RUN/final`` takes ``RUN/config.json`` as its ``--config``."""
    cfg = Config()
    final = run_final(args)
    if final is not None and not args.config:
        args.config = str(final.parent / "config.json")
    if args.config:
        cfg = from_dict(read_mapping("--config", args.config))
    checkpoint = None if final is not None else args.checkpoint  # a run's final/: its base is in the config
    flags = {"model": args.model, "checkpoint": checkpoint, "resolution": args.resolution}
    flags |= {"dtype": args.dtype, "num_frames": args.frames, "device": args.device}
    for key, value in flags.items():
        if value is not None:
            setattr(cfg, key, value)
    if final is not None and cfg.model == "tiny" and not _tensors_only(final):
        cfg.checkpoint, final = str(final), None  # the tiny model's final/ is a whole checkpoint
    return validate(cfg), final


def load_for_cli(cfg: Config, final: Path | None):
    """The adapter of ``cfg``, with a run's trained ``final/`` applied; says which weights it uses."""
    model = load_model(cfg)
    if final is not None and _tensors_only(final):  # a published run: its trained tensors merged in
        with reading("--checkpoint", final):  # files cut short: one line naming them
            apply_trained(model, final)
    elif final is not None:
        if not hasattr(model, "load_trained"):
            raise UserError(f"{final}: the {cfg.model!r} adapter cannot load a run's trained weights")
        with reading("--checkpoint", final):
            model.load_trained(final)
    print(f"weights: {cfg.checkpoint}" + (f" + {final}" if final is not None else ""))
    return model


def _settings(model, args, cfg: Config) -> dict:
    """Steps, guidance and shift: the flag, else (with ``--config``) the run's evaluation settings,
    else the checkpoint's."""
    from_file = bool(args.config)
    steps = args.steps or (cfg.eval_num_steps or cfg.num_steps if from_file else model.num_steps)
    guidance = args.cfg if args.cfg is not None else (cfg.eval_guidance_scale or model.guidance_scale)
    shift = args.shift if args.shift is not None else (cfg.shift if from_file else model.shift)
    return {"checkpoint": str(cfg.checkpoint), "steps": steps, "cfg": guidance, "shift": shift}


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


def _eval_parser() -> ArgParser:
    p = ArgParser(prog="flowcredit eval", description=main_eval.__doc__)
    _common_args(p)
    p.add_argument(
        "--prompts", default="test", help="'test' (default), 'train', a JSONL file or a text file of prompts"
    )
    p.add_argument(
        "--reward", default=None, help="shapes (the ShapeEval table; default), any reward or a mix"
    )
    p.add_argument("--reward_options", default=None, help="JSON of per-reward options, as the trainer's")
    p.add_argument("--seeds", default="0", help="comma-separated noise seeds, e.g. 0,1,2")
    p.add_argument("--samples-per-prompt", type=int, default=4, help="samples per prompt (default 4)")
    p.add_argument("--max-prompts", type=int, default=None, help="N prompts spread over the set (0: all)")
    p.add_argument("--out", default=None, help="directory for eval.json and grid.png")
    p.add_argument("--grid-prompts", type=int, default=12, help="prompts shown in grid.png")
    return p


def main_eval(argv: list[str] | None = None) -> int:
    """``flowcredit eval``: per-category ShapeEval table (or the mean of any ``--reward``), noise floor
    across seeds, grid PNG and JSON."""
    args = _eval_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, final = config_from_args(args)
    if args.reward_options is not None:
        cfg.reward_options = args.reward_options
    reward = args.reward or ((cfg.eval_reward or cfg.reward) if args.config else "shapes")
    shapes_eval = uses_shapeeval(reward)  # the per-category table needs ShapeEval metadata
    # --max-prompts N: N spread over the set, as a run picks its num_eval_prompts (and audit its prompts)
    metas = load_prompt_set(args.prompts, args.max_prompts or 0, True, shapes_eval, "--prompts")
    score = evaluate
    if not shapes_eval:
        built = build_reward(cfg, reward, named_only=True)
        check_metadata(built, metas, args.prompts)
        score = partial(evaluate_reward, reward=built)
    model = load_for_cli(cfg, final)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    settings, k = _settings(model, args, cfg), args.samples_per_prompt
    steps, shift, guidance = settings["steps"], settings["shift"], settings["cfg"]
    runs = [
        score(
            model,
            metas,
            seed=seed,
            samples_per_prompt=k,
            num_steps=steps,
            shift=shift,
            guidance_scale=guidance,
            return_images=i == 0,
        )
        for i, seed in enumerate(seeds)
    ]
    print(
        f"{len(metas)} prompts x {k} samples, {steps} ODE steps, cfg {guidance}, shift {shift}, "
        f"checkpoint {settings['checkpoint']}"
    )
    for seed, run in zip(seeds, runs, strict=True):
        print(f"\nseed {seed}\n{shapes.format_table(run['table'])}")
    pairs = list(zip(map(str, seeds), runs, strict=True))
    result = {
        **settings,
        "reward": reward,
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


def _sample_parser() -> ArgParser:
    p = ArgParser(prog="flowcredit sample", description=main_sample.__doc__)
    _common_args(p)
    p.add_argument("--prompt", required=True, help='e.g. "two red circles"')
    p.add_argument("--n", type=int, default=8, help="number of samples")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--out", required=True, help="PNG file to write")
    return p


def main_sample(argv: list[str] | None = None) -> int:
    """``flowcredit sample``: a row of ``n`` ODE samples of one prompt, saved as a PNG."""
    args = _sample_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg, final = config_from_args(args)
    model = load_for_cli(cfg, final)
    settings = _settings(model, args, cfg)
    noise = initial_noise(args.n, tuple(model.latent_shape), args.seed).to(
        next(model.net.parameters()).device
    )
    images = sample(
        model, [args.prompt] * args.n, noise, settings["steps"], settings["shift"], settings["cfg"]
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if images.ndim == 5:  # clips: one frame strip per row
        image_grid(images, [args.prompt] * args.n, 1, scale=4).save(out)
    else:
        image_grid(images, [args.prompt], args.n, scale=4).save(out)
    print(f"wrote {out} ({args.n} samples, {settings['steps']} steps, cfg {settings['cfg']})")
    return 0
