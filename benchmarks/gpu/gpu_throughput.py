"""Throughput of an SD3.5-Medium-sized pipeline with random weights: the adapter's velocity rate and one
GRPO iteration per preset, against the NFE floor (as ``benchmarks/speed/throughput.py`` does on the CPU).

No weights are downloaded. The pipeline is built in memory from diffusers classes on the default device
(CUDA if present): SD3.5-Medium's transformer architecture (2.24 B parameters) and SD3's VAE, in bf16 with
the VAE in float32, as ``SD3FlowModel.from_pretrained`` loads them. Only the text encoders are small
(1–2 random layers, word-level tokenizer), with SD3's output widths (CLIP-L 768, CLIP-G 1280, T5 4096)
and sequence lengths (77 CLIP + 256 T5 tokens), so the transformer sees real SD3.5 input shapes. The
trainer is handed this adapter (``build_session(cfg, model=…)``; loading weights is all it skips).
Random weights cost what trained ones do; the reward is jpeg compressibility (CPU).

    bash benchmarks/gpu/gpu_check.sh                                   # on the GPU machine
    flock /tmp/flowcredit-torch.lock .venv/bin/python benchmarks/gpu/gpu_throughput.py --small   # CPU check

``--small`` shrinks the transformer (2 layers, width 64), the images (64 px) and the VAE.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # tiny_diffusers' helpers
sys.path.insert(0, str(REPO / "benchmarks" / "memory"))  # sd35_configs: SD3.5-Medium's shapes

from sd35_configs import SD3_VAE, SD35_MEDIUM  # noqa: E402
from tiny_diffusers import _clip_config, _t5, tokenizer  # noqa: E402

from flowcredit.models.diffusers_common import default_device, resolve_dtype  # noqa: E402
from flowcredit.models.sd3 import SD3FlowModel  # noqa: E402
from flowcredit.presets import COMPARED_PRESETS, load_config  # noqa: E402
from flowcredit.run.session import build_session  # noqa: E402
from flowcredit.train import grpo_iteration  # noqa: E402

CLIP_TOKENS, T5_TOKENS = 77, 256  # SD3's text sequence: 77 CLIP tokens (L and G side by side) + 256 T5
PROMPTS = ["a photo of a red cat", "a big blue square on the sign", "a small green dog", "the yellow circle"]
SMALL_TRANSFORMER = SD35_MEDIUM | dict(num_layers=2, num_attention_heads=4, attention_head_dim=16)
SMALL_TRANSFORMER |= dict(caption_projection_dim=64, sample_size=8, pos_embed_max_size=16)
SMALL_TRANSFORMER["dual_attention_layers"] = (0,)
SMALL_VAE = SD3_VAE | dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4)


def clip_encoder(width: int):
    """A 1-layer random CLIP text encoder with projection, ``width`` wide (hidden = projection)."""
    from transformers import CLIPTextModelWithProjection

    config = _clip_config(projection_dim=width)
    config.update(dict(hidden_size=width, intermediate_size=width, num_hidden_layers=1))
    config.update(dict(num_attention_heads=width // 64, max_position_embeddings=CLIP_TOKENS))
    return CLIPTextModelWithProjection(config)


def word_tokenizer(max_length: int):
    """tiny_diffusers' word-level tokenizer, padding to SD3's ``max_length`` instead of its 16."""
    tok = tokenizer()
    tok.model_max_length = max_length
    return tok


def build_pipeline(small: bool, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight ``StableDiffusion3Pipeline`` on ``device``: transformer and text encoders in
    ``dtype``, VAE in float32, scheduler shift 3 (SD3.5)."""
    import diffusers

    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the device (a 2.5 B init on CPU is slow)
        transformer = diffusers.SD3Transformer2DModel(**(SMALL_TRANSFORMER if small else SD35_MEDIUM))
        vae = diffusers.AutoencoderKL(**(SMALL_VAE if small else SD3_VAE))
        encoders = [clip_encoder(768), clip_encoder(1280), _t5(4096)]  # CLIP-L, CLIP-G, T5-XXL widths
    text_encoder, text_encoder_2, text_encoder_3 = (e.to(dtype) for e in encoders)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer.to(dtype),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=word_tokenizer(CLIP_TOKENS),
        text_encoder_2=text_encoder_2,
        tokenizer_2=word_tokenizer(CLIP_TOKENS),
        text_encoder_3=text_encoder_3,
        tokenizer_3=word_tokenizer(T5_TOKENS),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_adapter(small: bool, resolution: int, dtype: str = "auto", seed: int = 0) -> SD3FlowModel:
    """The SD3 adapter on a fresh random pipeline, on the default device, as ``from_pretrained`` gives it."""
    pipe = build_pipeline(small, default_device(), resolve_dtype(dtype), seed)
    return SD3FlowModel(pipe, resolution=resolution).to(default_device())


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def velocity_rate(model, prompts_per_call: int, samples: int, trials: int = 2) -> float:
    """samples·forward/s of ``model.velocity`` (CFG rows counted twice, as ``nfe/*`` counts): best of
    ``trials`` timings of about ``samples`` samples, after a warm-up call; latents on the CPU, as the
    trainer passes them."""
    b, mult = prompts_per_call, model.guidance_passes
    cond = model.encode([PROMPTS[0]] * b)
    x, sigma = torch.randn(b, *model.latent_shape), torch.full((b,), 0.5)
    calls, best = max(2, samples // (b * mult)), math.inf
    with torch.no_grad():
        model.velocity(x, sigma, cond)
        for _ in range(trials):
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                model.velocity(x, sigma, cond)
            sync()
            best = min(best, time.perf_counter() - t0)
    return b * mult * calls / best


def preset_config(preset: str, args, run_dir: Path, prompts_file: Path):
    """A one-iteration config of ``preset`` on the random pipeline (no evaluation; LoRA r 32 / α 64)."""
    fields = dict(model="sd3", checkpoint="random-weights", resolution=args.resolution, dtype="auto")
    fields |= dict(num_steps=args.steps, prompts_per_iter=args.prompts, group_size=args.group)
    fields |= dict(batch_size=args.batch_size, reward="jpeg_compressibility", threads=args.threads)
    fields |= dict(train_prompts=str(prompts_file), eval_prompts=str(prompts_file), eval_every=0)
    fields |= dict(lora_rank=32, lora_alpha=64.0, iterations=1, run_dir=str(run_dir))
    if preset == "dense_grpo":
        fields["calibrate"] = False  # calibration sets ψ (noise levels), not the cost
    return load_config(preset, None, [s for k, v in fields.items() for s in (f"--{k}", str(v))])


def iteration_cost(preset: str, args, peak: float) -> dict:
    """Set-up and one ``grpo_iteration`` of ``preset``: seconds (total and per phase), NFE, the ratio
    to the floor (NFE ÷ peak rate) and the peak CUDA memory of the iteration (weights included)."""
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.txt"
        prompts_file.write_text("\n".join(PROMPTS) + "\n")
        t0 = time.perf_counter()
        cfg = preset_config(preset, args, Path(tmp) / "run", prompts_file)
        s = build_session(cfg, model=build_adapter(args.small, cfg.resolution, cfg.dtype, cfg.seed))
        setup = time.perf_counter() - t0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        m = grpo_iteration(s, 0)
        sync()
        seconds = time.perf_counter() - t0
    nfe = {k: int(m[f"nfe/{k}"]) for k in ("rollout", "values", "train")}
    floor = sum(nfe.values()) / peak
    memory = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    times = {k: m[f"time/{k}_s"] for k in ("rollout", "values", "reward")}  # the trainer's phase clock
    times["ppo_update"] = m["time/update_s"]
    cost = dict(preset=preset, setup_s=setup, seconds=seconds, nfe=nfe, floor_s=floor, ratio=seconds / floor)
    return cost | dict(phases=times, peak_memory_gib=memory)


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def print_iteration_row(c: dict) -> None:
    if "error" in c or "skipped" in c:
        print(f"| {c['preset']} | {c.get('error') or c['skipped']} | | | | | | |", flush=True)
        return
    nfe, ph, mem = c["nfe"], c["phases"], c["peak_memory_gib"]
    print(
        f"| {c['preset']} | {nfe['rollout']} / {nfe['values']} / {nfe['train']} | {c['floor_s']:.1f} "
        f"| {c['seconds']:.1f} | {c['ratio']:.2f}× | {ph.get('rollout', 0):.1f} / {ph['values']:.1f} / "
        f"{ph.get('ppo_update', 0):.1f} | {c['setup_s']:.1f} | {'-' if mem is None else f'{mem:.1f}'} |",
        flush=True,
    )


def save(results: dict) -> None:
    """Write ``results`` to ``--json`` (if given): after every measurement, so a killed run keeps its rows."""
    if results["settings"]["json"]:
        path = Path(results["settings"]["json"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


def measure_rates(args, results: dict) -> float:
    """The velocity rate per batch size into ``results``; returns the peak."""
    model = build_adapter(args.small, args.resolution)
    results["transformer_params"] = sum(p.numel() for p in model.net.parameters())
    results["latent_shape"], results["dtype"] = list(model.latent_shape), str(model.dtype)
    print(f"transformer {results['transformer_params'] / 1e9:.3f} B parameters, latents {model.latent_shape}")
    print("\n| prompts per call | rows per call (CFG) | samples·forward/s |\n|---|---|---|", flush=True)
    for b in args.batch_sizes:
        try:
            rate = velocity_rate(model, b, args.samples)
        except Exception as exc:  # e.g. out of memory at the largest batch: keep the other rows
            rate, results[f"velocity_error_{b}"] = math.nan, f"{type(exc).__name__}: {exc}"[:500]
        results["velocity"].append(
            dict(prompts_per_call=b, rows_per_call=b * model.guidance_passes, rate=rate)
        )
        print(f"| {b} | {b * model.guidance_passes} | {rate:.1f} |", flush=True)
        save(results)
    return max([r["rate"] for r in results["velocity"] if r["rate"] > 0] or [math.nan])


def measure_iterations(args, results: dict, peak: float, start: float) -> None:
    """One iteration per preset into ``results``; a preset due after ``--budget_s`` is skipped."""
    print(f"\n### One iteration vs its NFE floor (peak {peak:.1f} samples·forward/s)\n")
    print("| preset | NFE rollout / values / update | floor s | iteration s | ratio ", end="")
    print("| rollout / values / update s | set-up s | peak GiB |\n" + "|---" * 8 + "|", flush=True)
    for preset in args.presets:
        if time.perf_counter() - start > args.budget_s:
            cost = dict(preset=preset, skipped=f"skipped: over the {args.budget_s:.0f} s budget")
        else:
            try:
                cost = iteration_cost(preset, args, peak)
            except Exception as exc:  # one failing preset (e.g. out of memory) must not hide the others
                cost = dict(preset=preset, error=f"{type(exc).__name__}: {exc}"[:500])
        release_memory()
        results["iterations"].append(cost)
        print_iteration_row(cost)
        save(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="a tiny transformer, VAE and 64 px (CPU check)")
    p.add_argument("--json", default="", help="write the results here (rewritten after every measurement)")
    p.add_argument("--presets", default=",".join(COMPARED_PRESETS))
    p.add_argument("--batch_sizes", default="1,2,4,8,16", help="prompts per velocity call")
    p.add_argument("--samples", type=int, default=64, help="samples per velocity timing")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=2, help="prompt groups per iteration")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--batch_size", type=int, default=8, help="rows per model call in the trainer (CFG ×2)")
    p.add_argument("--budget_s", type=float, default=210, help="start no preset after this many seconds")
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    args = p.parse_args()
    args.presets, args.batch_sizes = args.presets.split(","), [int(b) for b in args.batch_sizes.split(",")]
    args.resolution = 64 if args.small else 512
    torch.set_num_threads(args.threads)
    import diffusers

    start, gpu = time.perf_counter(), torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = dict(device=gpu, torch=torch.__version__, diffusers=diffusers.__version__, settings=vars(args))
    print(f"{gpu}, torch {torch.__version__}, {'small' if args.small else 'SD3.5-Medium-sized'} pipeline")
    results |= dict(velocity=[], iterations=[])
    results["peak_rate"] = peak = measure_rates(args, results)
    release_memory()
    measure_iterations(args, results, peak, start)
    results["total_s"] = time.perf_counter() - start
    save(results)
    print(f"\n(total {results['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
