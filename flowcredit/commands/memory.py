"""``flowcredit memory``: the predicted peak GPU memory of each phase of a training run, with no GPU.

Builds the real-size pipeline of ``--model`` / ``--size`` (SD3.5-Medium or -Large, FLUX.1-dev) on fake
tensors and runs one iteration's phases through the library's own code
(:mod:`flowcredit.commands.memory_plan`); prints a table in GiB, or JSON in bytes with ``--json``.

    flowcredit memory --model sd3 --size medium --preset flow_grpo --resolution 512 --batch_size 8
    flowcredit memory --model flux --size dev --preset tp_grpo --gradient_checkpointing true --json

Any config field (``--batch_size``, ``--dtype``, ``--lora_rank``, ``--guidance_scale``,
``--gradient_checkpointing``, ``--max_sequence_length``, ``--beta``…) sets what it sets in ``train``.
Takes 10–60 s and a few GB of host memory on the CPU (the weights are never allocated).
"""

from __future__ import annotations

import json
import shlex

from flowcredit.cli_args import ArgParser, add_config_fields

PAPERS = [
    "--model",
    "sd3",
    "--resolution",
    "512",
    "--lora_rank",
    "32",
    "--lora_alpha",
    "64",
    "--dtype",
    "bfloat16",
]
"""Defaults of this command without ``--config`` (the papers' SD3.5-M settings), before the user's fields."""


def _parser() -> ArgParser:
    p = ArgParser(
        prog="flowcredit memory",
        description="Predict the peak GPU memory of each phase of a run (text encoding, rollout, values, "
        "reward, update, evaluation) on a fake-tensor real-size model, without a GPU. Defaults: sd3, 512 px, "
        "bfloat16, LoRA r 32 / α 64 (without --config); the config fields below override them and the "
        "preset's.",
    )
    p.add_argument("--preset", default="flow_grpo", help="the method's preset (default flow_grpo)")
    p.add_argument(
        "--config", default=None, help="a YAML/JSON config on top of the preset (e.g. RUN/config.json)"
    )
    p.add_argument(
        "--size",
        default="",
        help="the model's size: sd3 'medium' (default) or 'large', flux 'dev' (default)",
    )
    p.add_argument(
        "--tiny_text_encoders",
        action="store_true",
        help="1-layer text encoders with the real widths (the 2026-11-29 GPU check's pipeline)",
    )
    p.add_argument(
        "--memory_budget",
        default="",
        help="a GPU size such as 24GiB: choose the plan options that fit it (printed as flags for train), "
        "or fail naming the phase that does not fit",
    )
    p.add_argument(
        "--allow_quantization",
        action="store_true",
        help="with --memory_budget: the plan may store the frozen base in 8 bits (changes the numbers)",
    )
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table (GiB)")
    add_config_fields(p)
    return p


def format_table(result: dict) -> str:
    """The per-phase table in GiB, the peak and the attention kernel."""
    from flowcredit.commands.memory_plan import GIB, PARTS

    st = result["settings"]
    head = (
        f"{st['model']} {st['size']}, {st['dtype']}, {st['resolution'][0]}×{st['resolution'][1]} px, "
        f"batch_size {st['batch_size']} ({st['transformer_rows']} transformer rows), "
        f"LoRA r {st['lora_rank']}, "
        f"gradient checkpointing {'on' if st['gradient_checkpointing'] else 'off'}, "
        f"text encoders {st['text_encoder_size']} ({st['text_encoders']}), "
        f"decode chunk {st['decode_chunk']}, "
        f"base {st['base_quantization']}, reward {st['reward']}"
        + (f" ({st['reward_network']})" if st["reward_network"] else " (no network counted)")
    )
    lines = [head, "", f"| phase (GiB) | {' | '.join(PARTS)} | peak |", "|---" * (len(PARTS) + 2) + "|"]
    for phase, part in result["phases"].items():
        cells = " | ".join(f"{part[k] / GIB:.2f}" for k in PARTS)
        lines.append(f"| {phase} | {cells} | **{part['peak'] / GIB:.2f}** |")
    lines.append("")
    lines.append(f"peak: {result['peak'] / GIB:.2f} GiB in the {result['peak_phase']} phase")
    lines.append(f"attention kernel of the fake run: {result['attention_kernel']}")
    if result["attention_correction"]:
        lines.append(
            f"  (math kernel: {result['attention_correction'] / GIB:.2f} GiB of N×N probabilities taken out, "
            "as the GPU's flash / memory-efficient kernels save an O(N) logsumexp instead)"
        )
    lines.append("not counted: the CUDA context, allocator fragmentation")
    return "\n".join(lines)


def format_plan(plan: dict) -> str:
    """The budget's plan: the flags to add, its table, what was tried and the time it costs."""
    from flowcredit.commands.memory_plan import GIB

    flags = " ".join(f"--{k} {shlex.quote(str(v).replace('True', 'true'))}"
                     for k, v in plan["changes"].items())  # fmt: skip
    cost = plan["time_cost"]
    lines = [
        f"fits {plan['budget'] / GIB:.0f} GiB (keeping {plan['headroom'] / GIB:.0f} GiB for the CUDA context "
        f"and fragmentation) with: {flags or 'the settings as given'}",
        "",
        format_table(plan["estimate"]),
        "",
        "tried: "
        + "; ".join(
            f"{', '.join(t['changes']) or 'as given'} → {t['peak'] / GIB:.1f} GiB ({t['peak_phase']})"
            for t in plan["tried"]
        ),  # fmt: skip
        f"time cost against the settings as given: compute × {cost['compute_ratio']:.2f} "
        f"(+{cost['transformer_forwards_added']:.0f} transformer forwards per iteration), model calls "
        f"{cost['model_calls'][0]} → {cost['model_calls'][1]}, VAE calls {cost['vae_calls'][0]} → "
        f"{cost['vae_calls'][1]}, host↔device copies {cost['host_link_bytes'] / GIB:.1f} GiB "
        f"(≈ {cost['host_link_seconds']:.1f} s at 25 GB/s) per iteration",
    ]
    if cost["base_quantization"] != "none":
        lines.append(f"base stored in {cost['base_quantization']}: the numbers change (not a default)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from flowcredit.commands.memory_budget import fit, parse_bytes
    from flowcredit.commands.memory_plan import estimate
    from flowcredit.presets import load_config

    args, rest = _parser().parse_with_overrides(argv)
    cfg = load_config(args.preset, args.config, [*([] if args.config else PAPERS), *rest])
    size = args.size or ("dev" if cfg.model == "flux" else "medium")
    if args.memory_budget:
        budget = parse_bytes(args.memory_budget)
        plan = fit(cfg, budget, size, args.tiny_text_encoders, args.allow_quantization)
        print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
        return 0
    result = estimate(cfg, size, tiny_text=args.tiny_text_encoders)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
