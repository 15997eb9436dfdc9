"""The report of ``peer_flow_grpo.py`` and its verdict: the printed table of the side-by-side timings,
and the equality checks (log-probabilities re-scored by the other code, LoRA gradients of one update)
against :data:`TOLERANCES`; a failed check makes the benchmark exit 1."""

from __future__ import annotations

TOLERANCES = {"float32": (1e-5, 1e-4)}
"""dtype → (max |Δ log p| of one trajectory re-scored by the other code, ‖g − g_peer‖ / ‖g_peer‖ of the
LoRA gradient with ``cfg_uncond_grad`` false): float32 round-off, measured at most 2.4e-7 and 3.0e-6
(tiny SD3 and SD3.5-M shapes; docs/benchmarks.md), so 40× and 30× margins. Any other dtype: the
log-probabilities within ``LOW_PRECISION_LOGP`` and the gradient not checked: the codes round
differently (5–7e-4 in bfloat16) and so clip different rows."""
LOW_PRECISION_LOGP = 1e-2


def summarise(args, med: dict, checks, grads: dict) -> dict:
    """The report (JSON) and its printed table."""
    report = {
        "settings": vars(args),
        "seconds_median": med,
        "logp_max_abs_diff": dict(zip(("ours_on_peer", "peer_on_ours"), checks[:2])),
        "lora_grad_vs_peer": grads,
    }
    for side in ("peer", "before", "ours"):
        med[f"{side}/iteration"] = med[f"{side}/rollout"] + med[f"{side}/update"]
        report[f"{side}/iteration_s"] = med[f"{side}/iteration"]
        report[f"{side}/samples_per_s"] = args.group / med[f"{side}/iteration"]
    print(
        f"{args.size} SD3, {args.group} samples × {args.steps} steps, {args.resolution}px, {args.dtype}, "
        f"{args.device}, LoRA r={args.lora_rank}; median of {args.repeats} iterations after a warm-up"
    )
    print("| phase | Flow-GRPO s | flowcredit before s | flowcredit s | peer / before | peer / flowcredit |")
    print("|---|---|---|---|---|---|")
    for phase in ("rollout", "update", "iteration"):
        a, b, c = (med[f"{side}/{phase}"] for side in ("peer", "before", "ours"))
        print(f"| {phase} | {a:.4f} | {b:.4f} | {c:.4f} | {a / b:.2f}× | {a / c:.2f}× |")
    rates = [report[f"{side}/samples_per_s"] for side in ("peer", "before", "ours")]
    print("samples/s: Flow-GRPO {:.2f}, flowcredit before {:.2f}, flowcredit {:.2f}".format(*rates))
    ours_on_peer, peer_on_ours, first_ours, first_before = checks
    report["first_ratio_maxdev"] = {"ours": first_ours, "before": first_before}
    print(
        f"same trajectory, max |Δ log p|: ours on the peer's {ours_on_peer:.2e}, "
        f"theirs on ours {peer_on_ours:.2e}; the update's first max |r − 1|: {first_ours:.2e} "
        f"(before: {first_before:.2e})"
    )
    for key, label in (("cfg_uncond_grad_false", "false (Flow-GRPO's)"), ("cfg_uncond_grad_true", "true")):
        g = grads[key]
        print(
            f"same batch, LoRA gradient vs the peer's, cfg_uncond_grad {label}: "
            f"‖Δg‖/‖g‖ {g['rel_diff']:.2e}, cosine {g['cosine']:.6f}"
        )
    return report


def failures(report: dict, dtype: str) -> list[str]:
    """The equality checks of ``report`` past :data:`TOLERANCES` for ``dtype``, one line each."""
    logp_tol, grad_tol = TOLERANCES.get(dtype, (LOW_PRECISION_LOGP, None))
    out = [
        f"log-probabilities {side}: max |Δ| {diff:.2e} > {logp_tol:.0e}"
        for side, diff in report["logp_max_abs_diff"].items()
        if not diff <= logp_tol  # NaN fails too
    ]
    rel = report["lora_grad_vs_peer"]["cfg_uncond_grad_false"]["rel_diff"]
    if grad_tol is not None and not rel <= grad_tol:
        out.append(f"LoRA gradient, cfg_uncond_grad false: ‖Δg‖/‖g‖ {rel:.2e} > {grad_tol:.0e}")
    return out
