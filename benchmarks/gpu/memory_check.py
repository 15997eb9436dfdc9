"""The memory plan on a real GPU (issue 57): predicted against measured, per phase, and what the plan costs
in iteration time against the settings as given (the "80 GiB settings").

For each seed method (flow_grpo, tp_grpo, dense_grpo, stepwise_grpo) at the papers' SD3.5-Medium settings
(512 px, 10 steps, CFG 4.5, LoRA r 32 on the attention projections, bf16, ``batch_size`` 8), with the real
text encoders' sizes (CLIP-L, CLIP-G, T5-XXL) and a PickScore-sized reward network (CLIP ViT-H/14), all
random weights built in memory (nothing downloaded):
1. ``flowcredit memory --memory_budget`` chooses the plan for ``--budget`` (default 24 GiB) on fake tensors;
2. the plan runs for real: the same phases as the estimate (``memory_plan.run_phases``) on the CUDA
   model, with ``torch.cuda.max_memory_allocated`` read after each phase (peak statistics reset before);
3. two training iterations (``train`` with the model handed in; jpeg reward, so that the scored images
   are the only difference; DenseGRPO without its one-off ψ calibration) at the plan's settings and at
   the settings as given, timed from the run's timings.jsonl; an out-of-memory error at the settings as
   given is recorded, not raised.

    python benchmarks/gpu/memory_check.py --json $OUT/memory_check.json           # on the GPU machine
    python benchmarks/gpu/memory_check.py --small --device cpu --methods flow_grpo   # CPU dry run (minutes)

``--small`` shrinks every network (as tests/test_memory_plan.py does) so that the script's code paths run
on a CPU; its numbers mean nothing. ``--minutes`` stops starting new runs after that long (default 8:
one device call is at most 10 minutes). Results: JSON with the GPU's name, per method the plan, the
per-phase predicted and measured peaks, and the iteration seconds; docs/gpu.md quotes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from flowcredit.commands import memory_models  # noqa: E402
from flowcredit.commands.memory import PAPERS  # noqa: E402
from flowcredit.commands.memory_budget import fit, parse_bytes  # noqa: E402
from flowcredit.commands.memory_plan import GIB, PHASES, estimate, make_policy, run_phases  # noqa: E402
from flowcredit.presets import load_config  # noqa: E402

METHODS = ("flow_grpo", "tp_grpo", "dense_grpo", "stepwise_grpo")
RUN = ["--prompts_per_iter", "2", "--group_size", "8", "--batch_size", "8", "--reward", "pickscore"]
"""Two groups of 8 (the memory is per micro-batch: a larger group only adds micro-batches)."""


def shrink() -> None:
    """``--small``: 2-layer networks everywhere (the shapes of tests/test_memory_plan.py)."""
    small = memory_models.SD35_MEDIUM | dict(num_layers=2, num_attention_heads=2, attention_head_dim=16)
    small |= dict(caption_projection_dim=32, dual_attention_layers=(0,), pos_embed_max_size=16)
    memory_models.SIZES["sd3"]["medium"] = small
    memory_models.SD3_VAE = memory_models.SD3_VAE | dict(block_out_channels=(32, 32, 32, 32))
    tiny = dict(num_hidden_layers=1, intermediate_size=32, num_attention_heads=2)
    memory_models.TINY_TEXT = tiny
    clip = dict(text=dict(hidden_size=32, **tiny), vision=dict(hidden_size=32, **tiny))
    memory_models.REWARD_CLIPS["pickscore"] = clip | dict(projection_dim=16, act="gelu")


class CudaPeaks:
    """``probe`` of ``run_phases``: CUDA's peak allocated bytes per phase (reset before each)."""

    def __init__(self, device: str):
        self.device, self.peaks = torch.device(device), {}

    def before(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def after(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peaks[phase] = torch.cuda.max_memory_allocated()


def real_model(cfg, device: str, tiny_text: bool):
    """The random-weight pipeline of ``cfg`` on ``device``, placed and quantised as ``cfg`` says."""
    from flowcredit.models.memory_options import apply_memory_options

    dtype = torch.bfloat16 if cfg.dtype in ("bfloat16", "bf16") else torch.float32
    with torch.device(device), memory_models.default_dtype(dtype):
        model = memory_models.build_fake_model(
            cfg, "medium", memory_models.scheduler_of(cfg.model), tiny_text
        )
    model.to(device)
    apply_memory_options(cfg, model)
    return model


def measured_phases(cfg, device: str, tiny_text: bool) -> dict:
    """``run_phases`` on the real model with CUDA's peak per phase (``measured``)."""
    model = real_model(cfg, device, tiny_text)
    with torch.device(device):
        reward = memory_models.reward_networks(cfg)
    if reward is not None and reward.placement != "device":
        for module in reward.modules:
            module.to("cpu")
    policy = make_policy(cfg, model)
    probe = CudaPeaks(device)
    counted = run_phases(cfg, model, policy, reward, probe=probe)
    del model, policy, reward
    return {"counted": {k: v["peak"] for k, v in counted["phases"].items()}, "measured": probe.peaks}


def iteration_seconds(cfg, device: str, tiny_text: bool, iterations: int = 2) -> dict:
    """Seconds of each of ``iterations`` training iterations of ``cfg`` (jpeg reward), or the error."""
    from flowcredit.run.runlog import read_iteration_seconds
    from flowcredit.train import train

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.txt"
        prompts.write_text("a photo of a red cat\na big blue square on the sign\n")
        run = dataclasses.replace(
            cfg,
            reward="jpeg_compressibility",
            reward_options="",
            iterations=iterations,
            eval_every=0,
            train_prompts=str(prompts),
            eval_prompts=str(prompts),
            num_eval_prompts=2,
            eval_samples_per_prompt=1,
            run_dir=str(Path(tmp) / "run"),
            device=device,
            log_with="none",
            calibrate=False,  # DenseGRPO's ψ calibration is a one-off before the run, not an iteration
        )
        try:
            train(run, model=real_model(run, device, tiny_text))
        except torch.OutOfMemoryError as exc:
            return {"error": f"out of memory: {str(exc).splitlines()[0]}"}
        finally:
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
        return {"seconds": list(read_iteration_seconds(Path(run.run_dir)).values()), "peak": peak}


def check_method(method: str, budget: int, args) -> dict:
    small = ["--resolution", "64"] if args.small else []
    cfg = load_config(method, None, [*PAPERS, *RUN, "--device", args.device, *small])
    plan = fit(cfg, budget, "medium", args.tiny_text_encoders)
    planned = dataclasses.replace(cfg, **plan["changes"])
    out = {
        "changes": plan["changes"],
        "predicted": {k: v["peak"] for k, v in plan["estimate"]["phases"].items()},
    }
    out["time_cost"] = plan["time_cost"]
    out |= measured_phases(planned, args.device, args.tiny_text_encoders)
    out["as_given_predicted_peak"] = estimate(cfg, "medium", args.tiny_text_encoders)["peak"]
    out["iterations_plan"] = iteration_seconds(planned, args.device, args.tiny_text_encoders)
    out["iterations_as_given"] = iteration_seconds(cfg, args.device, args.tiny_text_encoders)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="24GiB")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="2-layer networks: a CPU dry run of the code paths")
    p.add_argument("--tiny_text_encoders", action="store_true", help="1-layer text encoders (less to build)")
    p.add_argument("--minutes", type=float, default=8.0, help="start no new method after this long")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args()
    if args.small:
        shrink()
    budget, start = parse_bytes(args.budget), time.time()
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu (dry run)"
    results = {"gpu": gpu, "torch": torch.__version__, "budget": budget, "small": args.small, "methods": {}}
    for method in args.methods.split(","):
        if time.time() - start > args.minutes * 60:
            results["methods"][method] = {"skipped": f"past {args.minutes} minutes"}
            continue
        results["methods"][method] = check_method(method, budget, args)
        report(method, results["methods"][method])
        if args.json:  # after every method: a timeout keeps what was done
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"{gpu}: done in {time.time() - start:.0f} s")


def report(method: str, r: dict) -> None:
    cells = " ".join(
        f"{ph} {r['predicted'][ph] / GIB:.1f}/{r['measured'].get(ph, float('nan')) / GIB:.1f}"
        for ph in PHASES
    )
    print(f"{method}: plan {r['changes']}; predicted/measured GiB: {cells}")
    print(f"  iterations s: plan {r['iterations_plan']}, as given {r['iterations_as_given']}")


if __name__ == "__main__":
    main()
