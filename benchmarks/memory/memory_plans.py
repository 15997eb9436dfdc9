"""What fits on 24, 48 and 80 GiB (issue 57; docs/gpu.md "What fits where"): ``flowcredit memory
--memory_budget`` for each seed method on SD3.5-Medium and for FLUX.1-dev, at the papers' settings with
the real text encoders and a real reward network, predicted on fake tensors (no GPU, no weights).

Settings: 512 px, 10 steps, CFG 4.5 (FLUX: distilled guidance 3.5), LoRA r 32 / α 64 on the attention
projections, bf16, ``batch_size`` 8 rows per model call, ``prompts_per_iter`` 8 × ``group_size`` 24; reward
PickScore (CLIP ViT-H/14, float32) unless the row says GenEval (Mask2Former Swin-S + CLIP ViT-L/14).
FLUX.1-dev may take an 8-bit base at 24 GiB (``--allow_quantization``; the numbers change).

    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/memory/memory_plans.py   # ~15 min on 2 cores

Writes benchmarks/results/memory_plans.json (every plan, its estimate, what it tried, its time cost) and
prints the markdown table docs/gpu.md quotes (``--table`` prints it from the JSON without recomputing).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from flowcredit.commands.memory import PAPERS  # noqa: E402
from flowcredit.commands.memory_budget import fit  # noqa: E402
from flowcredit.errors import ConfigError  # noqa: E402
from flowcredit.presets import load_config  # noqa: E402

GIB = 2**30
RESULTS = REPO / "benchmarks" / "results" / "memory_plans.json"
SETTINGS = ["--batch_size", "8", "--prompts_per_iter", "8", "--group_size", "24", "--num_steps", "10"]
BUDGETS = (24, 48, 80)
ROWS = [  # (label, model, preset, reward, extra fields, allow quantization)
    ("SD3.5-M flow_grpo", "sd3", "flow_grpo", "pickscore", [], False),
    ("SD3.5-M tp_grpo", "sd3", "tp_grpo", "pickscore", [], False),
    ("SD3.5-M dense_grpo", "sd3", "dense_grpo", "pickscore", [], False),
    ("SD3.5-M stepwise_grpo", "sd3", "stepwise_grpo", "pickscore", [], False),
    ("SD3.5-M flow_grpo, GenEval", "sd3", "flow_grpo", "geneval", [], False),
    ("FLUX.1-dev flow_grpo", "flux", "flow_grpo", "pickscore", ["--guidance_scale", "3.5"], True),
]
SHORT = {
    "text_encoders": "text {}",
    "gradient_checkpointing": "checkpointing",
    "decode_chunk": "decode {}",
    "reward_options": "reward offload",
    "batch_size": "batch {}",
    "base_quantization": "{} base",
}


def plan_row(model: str, preset: str, reward: str, extra: list[str], budget: int, quant: bool) -> dict:
    fields = [*PAPERS, "--model", model, *SETTINGS, "--reward", reward, *extra]
    cfg = load_config(preset, None, fields)
    try:
        plan = fit(cfg, budget * GIB, "dev" if model == "flux" else "medium", allow_quantization=quant)
    except ConfigError as exc:
        return {"fits": False, "error": str(exc)}
    return {"fits": True, **plan}


def cell(r: dict) -> str:
    if not r["fits"]:
        return "does not fit: " + r["error"].split(": ", 2)[-1].split(" with every")[0]
    est = r["estimate"]
    opts = ", ".join(SHORT[k].format(v) for k, v in r["changes"].items()) or "as given"
    cost = r["time_cost"]
    extra = f"compute ×{cost['compute_ratio']:.2f}" if cost["compute_ratio"] > 1.001 else ""
    if cost["host_link_bytes"]:
        extra += f"{', ' if extra else ''}{cost['host_link_seconds']:.1f} s copies"
    return f"{est['peak'] / GIB:.1f} ({est['peak_phase']}): {opts}" + (f"; {extra}" if extra else "")


def table(results: dict) -> str:
    head = "| setting | " + " | ".join(f"{b} GiB" for b in BUDGETS) + " |"
    lines = [head, "|---" * (len(BUDGETS) + 1) + "|"]
    for label, *_ in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(results[label][str(b)]) for b in BUDGETS) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="print the table from the saved JSON only")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(RESULTS.read_text())["rows"]))
        return
    start, rows = time.time(), {}
    for label, model, preset, reward, extra, quant in ROWS:
        rows[label] = {}
        for budget in BUDGETS:
            rows[label][str(budget)] = plan_row(model, preset, reward, extra, budget, quant)
            print(f"{label}, {budget} GiB: {cell(rows[label][str(budget)])}", flush=True)
    out = {"settings": SETTINGS, "papers": PAPERS, "seconds": round(time.time() - start), "rows": rows}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
