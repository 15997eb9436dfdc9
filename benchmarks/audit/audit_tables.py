"""The credit audit's published tables, rendered from its ``audit.json`` files (never typed by hand):
per checkpoint, each rule's Spearman ρ with the Monte-Carlo step effect per trained step and pooled,
its paired difference to Flow-GRPO with the pre-registered verdict, sign agreement and value calls,
then the noise ceiling (docs/benchmarks.md, "flowcredit audit"); and the README's comparison of
checkpoints, pooled. ``tests/test_published_results.py`` checks that the rows in README.md and
docs/benchmarks.md are these.

    .venv/bin/python benchmarks/audit/audit_tables.py base=benchmarks/results/audit/base_full \\
        halfway=benchmarks/results/audit/flow_grpo_mid_full
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {
    "flow_grpo": "Flow-GRPO (`flow_grpo`)",
    "dense": "DenseGRPO, ODE values (`dense`)",
    "turning_point": "TP-GRPO (`turning_point`)",
    "stepwise": "Stepwise-Flow-GRPO (`stepwise`)",
    "dense_euler1": "DenseGRPO, one-step values (`dense_euler1`)",
    "coca": "CoCA (`coca`)",
}
"""The README's names of the audited rules (a rule not listed is shown by its registry name)."""


def signed(x: float, digits: int) -> str:
    """``x`` with its sign, the minus typeset as in the docs (``−0.081``)."""
    return f"{x:+.{digits}f}".replace("-", "−")


def verdict(mean: float, half: float) -> str:
    """The pre-registered accuracy verdict of a paired difference ``mean ± half`` (95 %)."""
    if mean - half > 0:
        return "more accurate"
    if mean + half < 0:
        return "less accurate"
    return "level"


def paired(rule: dict) -> tuple[str, str]:
    """(``+0.036 ± 0.108``, ``level``): the rule's pooled ρ minus Flow-GRPO's, paired by prompt, and its
    verdict; empty strings for Flow-GRPO itself."""
    d = rule.get("spearman_minus_flow_grpo")
    if not d:
        return "", ""
    return f"{signed(d['mean'], 3)} ± {d['interval']:.3f}", verdict(d["mean"], d["interval"])


def checkpoint_table(report: dict) -> str:
    """One checkpoint's table: ρ per step (± 95 % over prompts), pooled, paired, sign, value calls."""
    steps = report["steps"]  # by position (a TreeGRPO tree's drawn steps): the k-th trained step
    label = "trained step {}" if report.get("steps_by_position") else "step {}"
    head = ["rule", *(label.format(s + bool(report.get("steps_by_position"))) for s in steps)]
    head += ["pooled", "− Flow-GRPO (paired)", "sign agreement"]
    lines = ["| " + " | ".join([*head, "value calls / trajectory"]) + " |", "|---" * (len(head) + 1) + "|"]
    for name, rule in report["rules"].items():
        rho = rule["spearman"]
        cells = [f"{signed(v, 2)} ± {h:.2f}" for v, h in zip(rho["per_step"], rho["per_step_interval"])]
        pooled = f"{signed(rho['pooled'], 3)} ± {rho['pooled_interval']:.3f}"
        sign = f"{rule['sign_agreement']['pooled']:.2f}"
        calls = f"{rule['value_calls_per_trajectory']:,.0f}"
        diff = " ".join(paired(rule)).strip()
        lines.append("| " + " | ".join([f"`{name}`", *cells, pooled, diff, sign, calls]) + " |")
    ceiling = [f"{c:.2f}" for c in report["ceiling"]["spearman_ceiling"]]
    mc = f"{report['mc_calls_per_trajectory']:,.0f} (Monte Carlo)"
    lines.append("| " + " | ".join(["noise ceiling (√ reliability)", *ceiling, "", "", "", mc]) + " |")
    return "\n".join(lines)


def cosine_line(report: dict) -> str:
    """The policy-gradient cosines with ``Δ̂``'s gradient, mean ± 95 % over the prompts that have them."""
    cos = report["gradient_cosine"]
    halves = cos.get("noise_halves")
    n = next(iter(cos.values()))["prompts"] if cos else 0
    head = f"Policy-gradient cosine with `Δ̂`'s gradient ({n} prompts"
    if halves:
        head += f"; the two halves' gradients: {halves['mean']:.2f} ± {halves['interval']:.2f}"
    rules = {k: v for k, v in cos.items() if k != "noise_halves"}
    parts = [f"`{k}` {signed(v['mean'], 2)} ± {v['interval']:.2f}" for k, v in rules.items()]
    return head + "): " + ", ".join(parts) + "."


def compare_table(reports: dict[str, dict]) -> str:
    """The README's table: per rule and checkpoint, pooled ρ and the paired difference to Flow-GRPO."""
    head = ["rule"]
    for label in reports:
        head += [f"{label}: ρ", "− Flow-GRPO, paired"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    names = list(next(iter(reports.values()))["rules"])
    for name in names:
        row = [LABELS.get(name, f"`{name}`")]
        for report in reports.values():
            rule = report["rules"][name]
            rho = rule["spearman"]
            diff, word = paired(rule)
            row.append(f"{signed(rho['pooled'], 3)} ± {rho['pooled_interval']:.3f}")
            row.append(f"{diff} ({word})" if diff else "")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def load(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "audit.json").read_text())


def main(argv: list[str] | None = None) -> int:
    pairs = [a.split("=", 1) for a in (sys.argv[1:] if argv is None else argv)]
    if not pairs or any(len(p) != 2 for p in pairs):
        print(__doc__, file=sys.stderr)
        return 2
    reports = {label: load(folder) for label, folder in pairs}
    for label, report in reports.items():
        print(f"### {label} ({report['settings']['n_prompts']} prompts)\n")
        print(checkpoint_table(report) + "\n\n" + cosine_line(report) + "\n")
    print(compare_table(reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
