"""Side by side with Flow-GRPO's own code: one Flow-GRPO iteration of the peer's code and of ours.

One iteration is the rollout with log-probabilities (then the decode of the final latents) and the
per-timestep clipped update (β = 0, one optimizer step per batch, as Flow-GRPO accumulates over its
timesteps). Both run on the same SD3 pipeline object, the same LoRA'd transformer (restored to the same
weights before each update), the same prompts, initial noise, group size, steps, noise level and
guidance, in one process, alternating, so the ratio is measured side by side.

    .venv/bin/python benchmarks/peer/peer_flow_grpo.py --peer ../shared/peers/flow_grpo       # tiny SD3, CPU
    python benchmarks/peer/peer_flow_grpo.py --peer PATH --size medium --device cuda --dtype bfloat16

``--size medium`` builds a random-weight pipeline whose transformer and VAE have SD3.5-Medium's
shapes (24 MMDiT blocks of width 1536, 16 latent channels, 1024 px), with one-layer text encoders of
the right widths (text encoding is outside the timed phases). The peer's code is imported from PATH at
run time and never copied: its sampling pipeline and SDE step with log-probability as they are, and its
per-timestep ``compute_log_prob`` read from ``scripts/train_sd3.py`` without running that script's
module code; the loop around it (ratio, clip, backward, optimizer step) follows its ``main``.

Equal work is checked, not assumed: each side's log-probabilities re-scored by the other's code on the
same trajectory must agree (the maximum difference is printed), and so must both sides' LoRA gradients
of one update on the same batch (the relative difference and the cosine are printed). Our side runs
with Flow-GRPO's ``cfg_uncond_grad: false`` (its ``compute_log_prob`` detaches the unconditional CFG
branch); the gradient with the library's default (``true``: through both branches) is printed beside
it, to show what the field changes. ``--max_sequence_length`` sets the T5 length of both sides (0: the
adapter's default, 16 tokens on the tiny tokenizers; Flow-GRPO encodes 128).

The two equality checks fail the run (exit status 1, after the report is printed and written) past
:data:`TOLERANCES`: in float32, 1e-5 for the log-probabilities and 1e-4 for the relative difference of
the gradients with ``cfg_uncond_grad`` false (measured: at most 2.4e-7 and 3.0e-6). A small run is a
test (``tests/test_peer_benchmark.py``: 2 samples × 3 steps, one timed iteration, a few seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from unittest import mock

import torch
from peer_code import load_peer, peer_backward, peer_rollout, peer_update  # beside this script
from peer_verdict import LOW_PRECISION_LOGP, TOLERANCES, failures, summarise  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "memory"))  # sd35_configs: SD3.5-Medium's shapes
from sd35_configs import SD3_VAE, SD35_MEDIUM  # noqa: E402

PROMPTS = ["a red square", "a photo of a cat", "a big blue circle on the sign", "a green triangle"]


def build_pipeline(size: str, directory: Path) -> Path:
    """A random-config SD3 pipeline: ``tiny`` (tests/tiny_diffusers.py) or ``medium`` (SD3.5-M shapes)."""
    sys.path.insert(0, str(REPO / "tests"))
    import tiny_diffusers

    if size == "tiny":
        return tiny_diffusers.build_sd3(directory)
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    vocab = len(tiny_diffusers.WORDS.split()) + 4

    def clip(width):
        cfg = CLIPTextConfig(vocab_size=vocab, hidden_size=width, intermediate_size=256, num_hidden_layers=1)
        cfg.num_attention_heads, cfg.projection_dim = width // 64, width
        cfg.max_position_embeddings, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 16, 0, 2, 3
        return CLIPTextModelWithProjection(cfg)

    t5 = T5Config(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=256, num_layers=1, num_heads=4)
    t5.pad_token_id, t5.eos_token_id = 0, 3
    transformer, vae = SD3Transformer2DModel(**SD35_MEDIUM), AutoencoderKL(**SD3_VAE)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=clip(768),
        tokenizer=tiny_diffusers.tokenizer(),
        text_encoder_2=clip(1280),
        tokenizer_2=tiny_diffusers.tokenizer(),
        text_encoder_3=T5EncoderModel(t5),
        tokenizer_3=tiny_diffusers.tokenizer(),
    )
    pipe.save_pretrained(str(directory))
    return directory


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Seconds of named phases, synchronised on the device."""

    def __init__(self, device):
        self.device, self.seconds = device, {}

    def __call__(self, name, fn, *args, **kwargs):
        sync(self.device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync(self.device)
        self.seconds.setdefault(name, []).append(time.perf_counter() - t0)
        return out


def our_rollout(s, cond, group, x0, r):
    """Our rollout as :func:`flowcredit.train.grpo_iteration` runs it: the iteration's plan, in the
    session's sampling context."""
    from flowcredit.run.plans import iteration_plan, levels_of, sample
    from flowcredit.run.rollout import seeded

    plan = iteration_plan(s.cfg, s.sigmas, r)
    levels = levels_of(plan, s.cfg, s.psi)
    with s.sampling_policy():
        rows, gen = (len(group), 0, len(group)), seeded(0, r, 2)
        sam = sample(s.model, cond, group, x0, plan, levels, s.step_fn, gen, rows, **s.rollout_opts)
    return plan, levels, sam


def joint_pair(self, joint, cond_only, uncond_only):
    """CFG's two branches as one pass of 2B rows whatever ``cfg_uncond_grad`` says (the code before
    issue 43; the unconditional half then detached by ``uncond_branch``)."""
    v_cond, v_uncond = joint()
    return v_cond, self.uncond_branch(v_uncond)


@contextlib.contextmanager
def paths_before(s):
    """Our side as it ran before issue 43: the rollout on peft's LoRA forward (no composed copies),
    and CFG as one pass of 2B rows in the update as in the rollout (``joint_pair``; no unconditional
    velocity kept from the rollout); the statistics are read back once per optimizer step as now (on
    the CPU the difference is not measurable)."""
    copies, s.sampling_copies = s.sampling_copies, False
    try:
        with (
            mock.patch.object(type(s.model), "guided_pair", joint_pair),
            mock.patch.object(type(s), "reuses_uncond", property(lambda self: False)),
        ):
            yield
    finally:
        s.sampling_copies = copies


def our_backward(s, rolled, adv, prompts):
    """Our update's backward passes (``step_loss`` of every trained step on all rows, weight 1/K, as
    ``ppo_update`` runs them at this geometry), no optimizer step."""
    from flowcredit.train import step_loss

    plan, levels, sam = rolled
    k, keep = sam.ro.logp.shape[1] - 1, torch.arange(len(sam.group))
    cond = s.model.encode(prompts)
    for i in range(k):  # timestep_fraction 0.99 of 10: all steps but the last, as peer_backward
        step_loss(s, plan, levels, sam, adv, prompts, cond, keep, i, 1.0 / k, 1.0)


def lora_gradient(params, backward) -> torch.Tensor:
    """The flat gradient ``backward()`` leaves on ``params`` (cleared before and after)."""
    for p in params:
        p.grad = None
    backward()
    flat = torch.cat([p.grad.detach().float().reshape(-1).cpu() for p in params])
    for p in params:
        p.grad = None
    return flat


def gradient_check(peer, s, pipe, rolled, adv, prompts, embeds, args) -> dict:
    """Both sides' LoRA gradients of one update on the same batch (our trajectory ``rolled``, its
    log-probabilities as the old ones, the same weights): ours with ``cfg_uncond_grad`` false
    (Flow-GRPO's) and true (the library default), each against the peer's, as the relative
    difference ``‖g − g_peer‖ / ‖g_peer‖`` and the cosine."""
    ro = rolled[2].ro
    sample_states, old = ro.states.to(s.model.device), ro.logp.to(s.model.device)
    adv = adv.to(s.model.device)
    peer_grad = lora_gradient(
        s.params, lambda: peer_backward(peer, pipe, sample_states, old, adv, embeds, args)
    )
    out = {}
    for through_uncond in (False, True):
        s.model.cfg_uncond_grad = through_uncond
        ours = lora_gradient(s.params, lambda: our_backward(s, rolled, adv.cpu(), prompts))
        key = "cfg_uncond_grad_true" if through_uncond else "cfg_uncond_grad_false"
        out[key] = {
            "rel_diff": ((ours - peer_grad).norm() / peer_grad.norm()).item(),
            "cosine": torch.nn.functional.cosine_similarity(ours, peer_grad, dim=0).item(),
        }
    s.model.cfg_uncond_grad = s.cfg.cfg_uncond_grad
    out["peer_grad_norm"] = peer_grad.norm().item()
    return out


@torch.no_grad()
def cross_check(peer, s, pipe, states, logps_peer, ro, cond, group, embeds, args) -> tuple[float, float]:
    """Max |Δ logp|: ours re-scoring the peer's trajectory, and the peer's re-scoring ours."""
    from flowcredit.sde import SAMPLERS

    ours_on_peer, peer_on_ours = 0.0, 0.0
    b = states.shape[0]
    pe, ne, pp, np_ = embeds
    config = types.SimpleNamespace(
        train=types.SimpleNamespace(cfg=True), sample=types.SimpleNamespace(guidance_scale=args.cfg)
    )
    config.sample.noise_level = args.noise_level
    sample = {
        "latents": ro.states[:, :-1].to(pipe.transformer.dtype),
        "next_latents": ro.states[:, 1:],
        "timesteps": pipe.scheduler.timesteps.repeat(b, 1),
    }
    for i in range(args.steps - 1):
        sigma, sigma_next = s.sigmas[i].item(), s.sigmas[i + 1].item()
        v = s.model.velocity(states[:, i], s.sigmas[i].expand(b), cond[group])
        step = SAMPLERS["flow_sde"](
            v, states[:, i], sigma, sigma_next, args.noise_level, x_next=states[:, i + 1]
        )
        ours_on_peer = max(ours_on_peer, (step.logp - logps_peer[:, i].float().cpu()).abs().max().item())
        _, logp, _, _ = peer["compute_log_prob"](
            pipe.transformer, pipe, sample, i, torch.cat([ne, pe]), torch.cat([np_, pp]), config
        )
        peer_on_ours = max(peer_on_ours, (logp.float().cpu() - ro.logp[:, i]).abs().max().item())
    return ours_on_peer, peer_on_ours


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", required=True, help="the Flow-GRPO repository (e.g. ../shared/peers/flow_grpo)")
    ap.add_argument("--size", choices=("tiny", "medium"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--resolution", type=int, default=0, help="pixels (0: 32 tiny, 1024 medium)")
    ap.add_argument("--group", type=int, default=8, help="samples per iteration (rows of one batch)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--noise_level", type=float, default=0.7)
    ap.add_argument("--cfg", type=float, default=4.5)
    ap.add_argument("--clip", type=float, default=1e-4, help="PPO clip range (Flow-GRPO's SD3 default)")
    ap.add_argument("--lora_rank", type=int, default=32)
    ap.add_argument(
        "--max_sequence_length", type=int, default=0, help="T5 tokens (0: the adapter's; Flow-GRPO: 128)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed iterations per side (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="", help="write the numbers as JSON here")
    args = ap.parse_args(argv)
    args.resolution = args.resolution or (32 if args.size == "tiny" else 1024)
    if not (Path(args.peer) / "flow_grpo" / "diffusers_patch" / "sd3_sde_with_logprob.py").is_file():
        ap.error(f"--peer {args.peer}: not a Flow-GRPO checkout (no flow_grpo/diffusers_patch/)")
    return args


def our_session(args, tmp: Path):
    """Our session on the pipeline (its transformer carries the LoRA both sides train)."""
    from flowcredit.config import Config
    from flowcredit.models.sd3 import SD3FlowModel
    from flowcredit.run.session import build_session
    from flowcredit.validation import validate

    pipe_dir = build_pipeline(args.size, tmp / "sd3")
    options = dict(dtype=args.dtype, device=args.device, resolution=args.resolution, guidance_scale=args.cfg)
    model = SD3FlowModel.from_pretrained(str(pipe_dir), **options)
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = Config(
        model="sd3", sampler="flow_sde", noise_level=args.noise_level, credit="flow_grpo",
        num_steps=args.steps, window_size=0, group_size=args.group, prompts_per_iter=1,
        batch_size=args.group, steps_per_update=args.steps - 1, clip_range=args.clip, beta=0.0,
        lora_rank=args.lora_rank, lora_alpha=float(args.lora_rank), threads=args.threads,
        max_sequence_length=args.max_sequence_length, cfg_uncond_grad=False,
        log_with="none", run_dir=str(tmp / "run"), reward="jpeg_compressibility",
        train_prompts=str(tmp / "prompts.txt"), eval_prompts=str(tmp / "prompts.txt"),
    )  # fmt: skip
    s = build_session(validate(cfg), model=model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a LoRA away from zero, so both sides train a live adapter
        for name, p in model.net.named_parameters():
            if "lora_B" in name:
                p.copy_(1e-3 * torch.randn(p.shape, generator=gen))
    return s


def measure(peer: dict, s, args) -> tuple[dict, tuple[float, float], dict]:
    """Median seconds per phase and side over ``args.repeats`` iterations (after one warm-up), the
    cross-checked log-probability differences and the gradient check (first iteration)."""
    from flowcredit.run.rollout import seeded
    from flowcredit.train import ppo_update

    model, pipe, device = s.model, s.model.pipe, s.model.device
    peer["optimizer"] = torch.optim.AdamW(s.params, lr=s.cfg.lr, weight_decay=s.cfg.weight_decay)
    weights = s.policy.trainable_state()
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(args.group)]
    group = keep = torch.arange(args.group)
    with torch.no_grad():
        cond = model.encode(prompts)
        embeds = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device,
            do_classifier_free_guidance=True, max_sequence_length=model.max_sequence_length,
        )  # fmt: skip  # (prompt, negative, pooled, negative pooled)
    seconds, checks, grads, first = {}, None, None, {"ours": [], "before": []}
    for r in range(args.repeats + 1):
        x0 = torch.randn(args.group, *model.latent_shape, generator=torch.Generator().manual_seed(r))
        adv = torch.randn(args.group, args.steps, generator=torch.Generator().manual_seed(100 + r))
        t = Timer(device)
        s.policy.load_trainable_state(weights)  # every side samples and updates from the same weights
        with torch.no_grad():
            torch.manual_seed(r)
            _, states, logps = t("peer/rollout", peer_rollout, peer, pipe, embeds, x0.to(device), args)
        pipe.scheduler.set_timesteps(args.steps, device=device)  # the peer's step looks t up here
        update_args = (peer, pipe, s.params, states.to(device), logps, adv.to(device), embeds, args)
        t("peer/update", peer_update, *update_args)
        for side in ("ours", "before"):
            with paths_before(s) if side == "before" else contextlib.nullcontext():
                s.policy.load_trainable_state(weights)
                with torch.no_grad():
                    rolled = t(f"{side}/rollout", our_rollout, s, cond, group, x0, r)
                    t(f"{side}/rollout", model.decode, rolled[2].ro.states[:, -1])  # the peer decodes too
                if checks is None:
                    checks = cross_check(
                        peer, s, pipe, states, logps, rolled[2].ro, cond, group, embeds, args
                    )
                    grads = gradient_check(peer, s, pipe, rolled, adv, prompts, embeds, args)
                m = t(f"{side}/update", ppo_update, s, *rolled, adv, prompts, keep, seeded(0, r, 3))
                first[side].append(m["stats/first_ratio_maxdev"])
        if r > 0:  # the first iteration warms up
            for k, v in t.seconds.items():
                seconds.setdefault(k, []).append(sum(v))
    checks = (*checks, max(first["ours"]), max(first["before"]))
    return {k: statistics.median(v) for k, v in seconds.items()}, checks, grads


def main(argv: list[str] | None = None) -> int:
    """Run, print and (``--out``) write the report; exit status 1 if an equality check fails."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    peer = load_peer(Path(args.peer).resolve())
    with tempfile.TemporaryDirectory() as tmp:
        med, checks, grads = measure(peer, our_session(args, Path(tmp)), args)
    report = summarise(args, med, checks, grads)
    report["failures"] = failures(report, args.dtype)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for line in report["failures"]:
        print(f"FAIL: {line}", file=sys.stderr)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
