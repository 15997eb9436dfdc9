"""``flowcredit demo`` (``make demo``): fine-tune the shipped tiny model on the CPU with the ``demo``
preset, in a fresh ``runs/demo-<time>`` directory, and print the before/after summary, where the
before/after image is, and the ``flowcredit eval`` command that scores the final weights as the run
did."""

from __future__ import annotations

import time
from pathlib import Path

from flowcredit.cli_args import ArgParser, add_config_fields
from flowcredit.config import Config
from flowcredit.presets import load_config


def _parser() -> ArgParser:
    p = ArgParser(
        prog="flowcredit demo",
        description="Fine-tune the shipped tiny model on the CPU with the demo preset (make demo). Any "
        "config field overrides the preset; --run_dir defaults to a fresh runs/demo-<time>.",
    )
    add_config_fields(p)
    return p


def main(argv: list[str] | None = None) -> int:
    _, overrides = _parser().parse_with_overrides(list(argv or []))
    if "--run_dir" not in overrides[::2]:
        overrides += ["--run_dir", time.strftime("runs/demo-%Y%m%d-%H%M%S")]
    cfg = load_config("demo", None, overrides)
    print(
        f"flowcredit demo: {cfg.credit} with LoRA r={cfg.lora_rank} on the built-in model, "
        f"{cfg.iterations} iteration{'' if cfg.iterations == 1 else 's'}, outputs in {cfg.run_dir}/",
        flush=True,
    )
    from flowcredit.train import train

    train(cfg)
    print(afterword(cfg))
    return 0


def afterword(cfg: Config) -> str:
    """Where the before/after images are, and the ``flowcredit eval`` command that reproduces the
    held-out score: the run's final weights, steps, guidance and shift (``--config``), and the same
    prompts, samples per prompt and noise seed as its evaluation."""
    run = Path(cfg.run_dir)
    lines = []
    pairs = sorted(run.glob("grid_before_after_*.png"))
    if pairs:
        lines.append(
            f"  before | after: {', '.join(str(p) for p in pairs)} (the same prompts and noise; "
            "green frame = pass, red = fail, soft score under each sample)"
        )
    lines.append(  # --config: the run's final weights with its steps, guidance and shift
        f"  the held-out score again: flowcredit eval --config {run / 'config.json'} --max-prompts "
        f"{cfg.num_eval_prompts} --samples-per-prompt {cfg.eval_samples_per_prompt} --seeds {cfg.eval_seed}"
    )
    return "\n".join(lines)
