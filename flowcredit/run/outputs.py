"""What a run says and leaves: its label (:func:`run_label`), notes at its start (:func:`start_notes`),
and at its end the final weights, ``summary.json`` and the printed before/after summary."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

from safetensors.torch import save_file

from flowcredit.rewards import uses_shapeeval
from flowcredit.run.runlog import read_metrics


def final_artifacts(s, elapsed: float, stopped_early: str | None = None) -> dict:
    """Write ``final/`` (:func:`export_final`), ``summary.json``, and print the summary of the run
    ``s`` (a ``flowcredit.run.session.Session``); returns the summary (``{}`` off rank 0). Every rank
    calls it under FSDP (the export gathers the weights collectively), rank 0 alone otherwise.
    ``stopped_early``: what cut the run short of ``cfg.iterations`` (Ctrl-C, ``max_minutes``)."""
    export_final(s)
    if not s.dist.is_main:
        return {}
    summary = run_summary(s, elapsed)
    if stopped_early:
        summary["stopped_early"] = {"by": stopped_early, "iterations": s.cfg.iterations}
    if s.guard is not None:  # what the reward-hacking guard saw (docs/guard.md)
        st = s.guard.state
        summary["guard"] = {"action": s.cfg.guard, "best": st["best"], "alarms": st["alarms"]}
        summary["guard"]["rollbacks"] = st["rollbacks"]
        # a rollback at the last evaluation: final/ holds best/'s weights, not those "after" measured
        summary["guard"]["final_is_best"] = st.get("last_rollback") == summary["iterations"]
    (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, run_label(s.cfg), str(s.run_dir)))
    return summary


def export_final(s, final: Path | None = None) -> None:
    """``final/`` (or ``final``, a snapshot's folder): the trainable tensors, plus the adapter's own
    export; the EMA weights when ``ema_decay`` is set (the weights the evaluations measured). Under
    FSDP each rank swaps in its EMA shards, then rank 0 writes the gathered weights
    (``Dist.unsharded``)."""
    with s.ema.applied() if s.ema is not None else contextlib.nullcontext(), s.dist.unsharded(s.model):
        if not s.dist.is_main:
            return
        final = s.run_dir / "final" if final is None else final
        final.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in s.policy.trainable_state().items()},
            str(final / "trainable.safetensors"),
        )
        s.model.save_final(s.policy, final)


def run_summary(s, elapsed: float) -> dict:
    """Minutes, iterations, and per evaluated set the soft score before, after and at best, with the
    noise floor measured at the start."""
    rows = read_metrics(s.run_dir)
    evals = [r for r in rows if "eval/test/soft" in r]
    summary = {"minutes": elapsed / 60, "iterations": rows[-1]["iteration"] if rows else 0}
    eval_reward = s.cfg.eval_reward or s.cfg.reward
    summary["score"] = "soft" if uses_shapeeval(eval_reward) else f"mean {eval_reward}"
    for name in ("test", "train"):
        if evals and f"eval/{name}/soft" in evals[0]:
            summary[name] = {
                "before": evals[0][f"eval/{name}/soft"],
                "after": evals[-1][f"eval/{name}/soft"],
                "best": max(r[f"eval/{name}/soft"] for r in evals),
                "noise_floor": s.history.get(f"floor/{name}/soft", math.nan),
            }
    return summary


def run_label(cfg) -> str:
    """What a run trains, for its progress bar and summary: the preset's name where the config keeps it
    (a ``preset`` field), else the credit rule, with the update rule unless it is the default ``clipped``
    (``turning_point``, ``flow_grpo+ratio_norm``)."""
    preset = getattr(cfg, "preset", "")
    if preset:
        return preset
    return cfg.credit if cfg.update == "clipped" else f"{cfg.credit}+{cfg.update}"


def start_notes(cfg) -> list[str]:
    """The lines printed at the start of a run whose scores differ from other runs' for a known reason,
    decided by its settings: evaluation without classifier-free guidance (guidance 1, training's
    ``guidance_scale`` unless ``eval_guidance_scale`` is set), as DiffusionNFT's and AWM's presets
    evaluate. The built-in model scores 0.581 there against 0.634 at its default guidance 2 (16
    held-out prompts × 8 samples, seed 1234)."""
    if (cfg.eval_guidance_scale or cfg.guidance_scale) != 1.0:
        return []
    how = "eval_guidance_scale 1" if cfg.eval_guidance_scale else "guidance_scale 1, as training samples"
    return [
        f"flowcredit: note: evaluation samples without classifier-free guidance ({how}), so its scores, "
        "the starting one too, read lower than at the model's default guidance (built-in model: 0.581 "
        "against 0.634 on 16 held-out prompts); --eval_guidance_scale W evaluates at W"
    ]


def format_summary(summary: dict, label: str, run_dir: str) -> str:
    n = summary["iterations"]
    lines = [f"flowcredit: {n} iteration{'' if n == 1 else 's'} of {label} in {summary['minutes']:.1f} min"]
    score = summary.get("score", "soft")
    for name in ("train", "test"):
        if name in summary:
            e = summary[name]
            lines.append(
                f"  eval {name:>5} ({score}, ODE, fixed noise): before {e['before']:.3f} → after "
                f"{e['after']:.3f} (best {e['best']:.3f}); noise floor ±{e['noise_floor']:.3f}"
            )
    guard = summary.get("guard")
    if guard is not None:
        alarms, best = guard["alarms"], guard["best"] or {}
        when = f"alarms at iterations {', '.join(str(a[0]) for a in alarms)}" if alarms else "no alarm"
        lines.append(
            f"  guard ({guard['action']}): {when}; {guard['rollbacks']} rollbacks; best/ is iteration "
            f"{best.get('iteration')} by {best.get('by')} ({best.get('score', math.nan):.3f})"
        )
        if guard["final_is_best"]:
            lines.append("  rolled back at the last evaluation: final/ holds best/'s weights (not 'after')")
    if "stopped_early" in summary:
        early = summary["stopped_early"]
        lines.append(
            f"  stopped early by {early['by']} after {summary['iterations']} of {early['iterations']} "
            "iterations: this is not the full run of these settings (continue it with --resume)"
        )
    folders = "final/, best/" if guard is not None else "final/"
    lines.append(f"  outputs in {run_dir}/ (metrics.jsonl, reward_curve.png, grid_*.png, {folders})")
    return "\n".join(lines)
