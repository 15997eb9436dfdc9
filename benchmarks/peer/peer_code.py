"""Flow-GRPO's own code, driven as its training script drives it (for ``peer_flow_grpo.py``).

The peer's sampling pipeline and SDE step with log-probability are imported from the path the user
gives, its per-timestep ``compute_log_prob`` compiled alone from ``scripts/train_sd3.py`` (the script's
module code, which parses flags and imports its training stack, is not run): nothing of it is copied
here. The loop around them (ratio, clip, backward, optimizer step) follows the script's ``main``.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import torch


def peer_function(script: Path, name: str, namespace: dict):
    """Function ``name`` of the peer's ``script``, compiled alone from its source (the script's module
    code, which parses flags and imports its training stack, is not run)."""
    tree = ast.parse(script.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    code = compile(ast.Module(body=[node], type_ignores=[]), str(script), "exec")
    exec(code, namespace)  # noqa: S102 - the peer's own function, from the path the user gave
    return namespace[name]


def load_peer(root: Path) -> dict:
    """The peer's sampling pipeline and per-timestep log-probability, imported from ``root``."""
    sys.path.insert(0, str(root))
    from flow_grpo.diffusers_patch.sd3_pipeline_with_logprob import pipeline_with_logprob
    from flow_grpo.diffusers_patch.sd3_sde_with_logprob import sde_step_with_logprob

    namespace = {"torch": torch, "sde_step_with_logprob": sde_step_with_logprob}
    compute = peer_function(root / "scripts" / "train_sd3.py", "compute_log_prob", namespace)
    return {"pipeline_with_logprob": pipeline_with_logprob, "compute_log_prob": compute}


def peer_rollout(peer, pipe, embeds, x0, args):
    """The peer's sampling pipeline: images, states ``(B, N + 1, …)`` and log-probs ``(B, N)``."""
    pe, ne, pp, np_ = embeds
    images, latents, logps = peer["pipeline_with_logprob"](
        pipe,
        prompt_embeds=pe,
        pooled_prompt_embeds=pp,
        negative_prompt_embeds=ne,
        negative_pooled_prompt_embeds=np_,
        num_inference_steps=args.steps,
        guidance_scale=args.cfg,
        output_type="pt",
        height=args.resolution,
        width=args.resolution,
        noise_level=args.noise_level,
        latents=x0.to(pipe.transformer.dtype),
    )
    return images, torch.stack(latents, dim=1).float(), torch.stack(logps, dim=1)


def peer_update(peer, pipe, params, states, logps, adv, embeds, args):
    """Flow-GRPO's per-timestep clipped update (train_sd3.py's loop at β = 0): every trained
    timestep's loss backpropagated, one optimizer step for the batch (gradient accumulation)."""
    peer_backward(peer, pipe, states, logps, adv, embeds, args)
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    peer["optimizer"].step()
    peer["optimizer"].zero_grad(set_to_none=True)


def peer_backward(peer, pipe, states, logps, adv, embeds, args):
    """The backward passes of :func:`peer_update` (the gradient it steps with), no optimizer step."""
    pe, ne, pp, np_ = embeds
    b, k = states.shape[0], args.steps - 1  # timestep_fraction 0.99 of 10: all steps but the last
    sample = {
        "latents": states[:, :-1].to(pipe.transformer.dtype),
        "next_latents": states[:, 1:],
        "timesteps": pipe.scheduler.timesteps.repeat(b, 1),
        "log_probs": logps,
    }
    config = types.SimpleNamespace(
        train=types.SimpleNamespace(cfg=True), sample=types.SimpleNamespace(guidance_scale=args.cfg)
    )
    config.sample.noise_level = args.noise_level
    for j in range(k):
        _, logp, _, _ = peer["compute_log_prob"](
            pipe.transformer, pipe, sample, j, torch.cat([ne, pe]), torch.cat([np_, pp]), config
        )
        ratio = torch.exp(logp - sample["log_probs"][:, j])
        a = adv[:, j]
        unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1.0 - args.clip, 1.0 + args.clip)
        (torch.mean(torch.maximum(unclipped, clipped)) / k).backward()
