"""``flowcredit demo`` (``make demo``): fine-tune the shipped tiny model on the CPU with the ``demo``
preset, in a fresh ``runs/demo-<time>`` directory, and print the before/after summary."""

from __future__ import annotations

import time

from flowcredit.presets import load_config


def main(argv: list[str] | None = None) -> int:
    overrides = list(argv or [])
    if "--run_dir" not in overrides:
        overrides += ["--run_dir", time.strftime("runs/demo-%Y%m%d-%H%M%S")]
    cfg = load_config("demo", None, overrides)
    print(
        f"flowcredit demo: {cfg.credit} with LoRA r={cfg.lora_rank} on the built-in model, "
        f"{cfg.iterations} iterations, outputs in {cfg.run_dir}/",
        flush=True,
    )
    from flowcredit.train import train

    train(cfg)
    return 0
