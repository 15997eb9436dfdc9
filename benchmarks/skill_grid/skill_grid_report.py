"""The skill comparison's report from the runs published in git (``flowcredit bench --task skill
--publish DIR``): ``DIR/../results.json`` and ``DIR/../table.md`` — held-out scores (86 prompts × 16
samples × noise seeds 7001/7002) of the base checkpoint and of every finished run, each arm's change
from the base, paired differences to the Flow-GRPO arm (``skill``) with 95 % t-intervals over the
seeds both ran, and a verdict per paper claim (flowcredit/commands/bench_skill_report.py);
``DIR/../compare.png`` shows the same per category, every seed a dot, and ``DIR/../curves.png`` the
training reward per arm against iterations and against network calls spent (both drawn by
``skill_grid_figures.py``, beside this script). Runs scored on the
confirmation set too (records' ``"confirm"``, the base's included) get a section of their own.

    .venv/bin/python benchmarks/skill_grid/skill_grid_report.py benchmarks/results/skill_compare
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flowcredit.commands.bench_skill import run_cost, skill_report
from flowcredit.commands.bench_skill_report import ARM_NAMES, FIXES, VERDICT_METRICS
from flowcredit.tasks.shapes import CATEGORIES, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the figures, beside this script
import skill_grid_figures as figures  # noqa: E402
from skill_grid_plan import timed_seconds  # noqa: E402


def _cell(mean_half) -> str:
    mean, half = mean_half
    return f"{mean:+.3f}" + (f" ± {half:.3f}" if half == half else " (one seed)")


def _label(arm: str, rep: dict) -> str:
    """The arm's name, followed by † if some of its runs predate a fix (``before_fix``, FIXES)."""
    return arm + " †" * bool(rep["arms"].get(arm, {}).get("before_fix"))


def fix_notes(rep: dict) -> list[str]:
    """The note on the arms marked †: per fix (FIXES), the runs made before it and what they did."""
    lines = []
    for commit, at, _, what in FIXES:
        runs = [
            f"{arm} (seeds {', '.join(map(str, a['before_fix'][commit]))})"
            for arm, a in rep["arms"].items()
            if commit in a.get("before_fix", {})
        ]
        if runs:
            lines += [
                f"† Run before the fix of {at[:10]} (commit {commit}): {what}.",
                f"Runs: {'; '.join(runs)}. Their numbers are of the rule as it was, not as it is;",
                "rerunning them replaces them.",
                "",
            ]
    return lines


def progress(out: Path) -> list[str]:
    """How far the grid got: the finished runs (``runs/``) and the parked ones (``inflight/``, with the
    iteration of their checkpoint)."""
    done = [f.stem for f in sorted((out / "runs").glob("*-seed*.json"))]
    parked = []  # a parked copy of a run that has finished since is stale: the finished result counts
    for run in sorted(p for p in (out / "inflight").glob("*") if p.is_dir() and not p.name.startswith(".")):
        if run.name in done:
            continue
        at = json.loads((run / "checkpoint" / "state.json").read_text())["iteration"]
        total = json.loads((run / "config.json").read_text())["iterations"]
        parked.append(f"{run.name} (checkpoint at iteration {at} of {total})")
    return [
        "## Progress",
        "",
        f"Finished and evaluated: {', '.join(done) or 'none'}.",
        f"Parked, resumable (docs/benchmarks.md): {', '.join(parked) or 'none'}.",
        "",
    ]


def time_ratio(arm: str, times: dict, iterations: float = 1.0) -> str:
    """``arm``'s seconds per iteration ÷ Flow-GRPO's (``skill``), from ``skill_rate.py --arms --out``
    (one iteration of each arm, timed side by side with Flow-GRPO's in one run: ``timed_seconds``), and
    per run (× ``iterations``, the arm's iterations ÷ Flow-GRPO's) where that differs; "" where it was
    not timed."""
    name = arm.removeprefix("skill-")  # "skill" stays "skill"
    arms = timed_seconds(times)
    if name not in arms or "skill" not in arms:
        return ""
    ratio = arms[name] / arms["skill"]
    return f"{ratio:.2f}×" + (f" ({ratio * iterations:.2f}× per run)" if iterations != 1.0 else "")


def _iterations(cost: dict) -> float:
    return round(cost["train_nfe"] / cost["nfe_per_iteration"])


def cost_table(costs: dict, gpu: bool, times: dict, rep: dict | None = None) -> list[str]:
    """Network calls and minutes per arm; with ``times`` (``iteration_times.json``), the seconds per
    iteration ÷ Flow-GRPO's timed side by side too."""
    timed = bool(times.get("arms"))
    head = ["arm", "n", "network calls per iteration", "training calls", "ψ calibration calls"]
    head += ["seconds per iteration ÷ Flow-GRPO's"] * timed + ["GPU wall-minutes" if gpu else "CPU-minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, c in costs.items():
        name = _label(arm, rep) if rep else arm
        row = [name, str(c["n"]), f"{c['nfe_per_iteration']:,.0f}", f"{c['train_nfe']:,.0f}"]
        row += [f"{c['calibration_nfe']:,.0f}"]
        if timed:
            iterations = _iterations(c) / _iterations(costs["skill"]) if "skill" in costs else 1.0
            row += [time_ratio(arm, times, iterations)]
        lines.append("| " + " | ".join([*row, f"{c['cpu_minutes']:.0f}"]) + " |")
    where = (
        "GPU wall-minutes: of runs that shared one GPU and its CPU cores (several at a time"
        if gpu
        else "CPU-minutes: wall minutes × threads on the machine that ran it (with whatever else ran beside"
    )
    lines += ["", where + " and at whatever speed the host had that day): network calls are the cost"]
    lines += ["axis; minutes are indicative only."]
    if timed:
        cpu, threads = times.get("cpu", {}).get("model", "?"), times.get("threads", "?")
        lines += [
            "Seconds per iteration ÷ Flow-GRPO's: iteration 0 of each arm from the same start, timed side by",
            f"side in one run (`benchmarks/speed/skill_rate.py --arms`, best of its repeats; {cpu},",
            f"{threads} threads, `iteration_times.json`): the time ratio on a quiet machine.",
        ]
        seen = set(times["arms"])
        for run in times.get("later", []):
            arms = ", ".join(f"`{arm}`" for arm in run["arms"] if arm not in seen)
            seen |= set(run["arms"])
            lines += [
                f"Timed later, beside Flow-GRPO's iteration in a run of their own ({run['date']}, "
                f"{run['cpu']['model']}, {run['threads']} threads): {arms}."
            ]
    return lines


def table(rep: dict, gpu: bool = False, times: dict | None = None) -> str:
    """The markdown report; ``gpu``: the runs shared one GPU, so their minutes are wall minutes;
    ``times``: iteration times measured side by side (``iteration_times.json``), a column of the costs."""
    times = times or {}
    lines = ["# The skill comparison (held-out, 86 prompts × 16 samples × noise seeds 7001, 7002)", ""]
    base = rep["base"]
    lines += [
        f"Base checkpoint: strict {base['strict']['overall']:.3f}, soft {base['soft']['overall']:.3f} "
        f"(per image: strict {base['strict']['per_image']:.3f}).",
        "",
        *fix_notes(rep),
    ]
    head = ["arm", "seeds", "strict − base", "soft − base", "strict per image", *CATEGORIES]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += change_rows(rep["arms"], CATEGORIES, lambda arm: _label(arm, rep))
    lines += ["", "## Paired differences to Flow-GRPO (`skill`), same seeds", ""]
    head = ["arm", "seeds", "strict", "soft", "strict per image", *CATEGORIES]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, p in rep["paired"].items():
        d = p["diff"]
        cats = [_cell(d[f"strict/{c}"]) for c in CATEGORIES]
        row = [_label(arm, rep), ",".join(map(str, p["seeds"])), _cell(d["strict/overall"])]
        row += [_cell(d["soft/overall"])]
        lines.append("| " + " | ".join([*row, _cell(d["strict/per_image"]), *cats]) + " |")
    lines += ["", "## Verdicts against Flow-GRPO (rule and margin fixed 2026-12-04, docs/benchmarks.md)", ""]
    lines += verdict_lines(rep)
    lines += ["", "## Cost per run (mean over seeds)", "", *cost_table(rep.get("cost", {}), gpu, times, rep)]
    lines += ["", "## Claims", "", *claim_lines(rep)]
    if "confirm" in rep:
        lines += ["", *confirm_lines(rep["confirm"])]
    return "\n".join(lines) + "\n"


def change_rows(arms: dict, categories, label) -> list[str]:
    """One table row per arm: its seeds, strict and soft change over the base, per image and per
    category (``label(arm)`` names the arm)."""
    rows = []
    for arm, a in arms.items():
        ch, parts = a["change_from_base"], a["change_by_part"]
        row = [label(arm), ",".join(map(str, a["seeds"])), _cell(ch["strict"]), _cell(ch["soft"])]
        row += [_cell(parts["strict/per_image"]), *(_cell(parts[f"strict/{c}"]) for c in categories)]
        rows.append("| " + " | ".join(row) + " |")
    return rows


def verdict_lines(rep: dict) -> list[str]:
    """The verdict table: per arm what it is (``ARM_NAMES``), its n, each verdict with what its label
    must say (``label``: unreliable spread, a rule written after its seeds), and the planning figure."""
    head = ["arm", "method", "n", "held-out strict (primary)", "strict per image"]
    lines = ["| " + " | ".join([*head, "seeds to end the primary verdict* |"]), "|---|---|---|---|---|---|"]
    for arm, p in rep["paired"].items():
        v, needed = p.get("label", p["verdict"]), p.get("seeds_for_verdict", {}).get("strict/overall")
        ended = "over 40" if needed is None else ("ended" if needed == len(p["seeds"]) else str(needed))
        row = [_label(arm, rep), ARM_NAMES.get(arm, arm), str(len(p["seeds"]))]
        lines.append("| " + " | ".join([*row, v["strict/overall"], v["strict/per_image"], ended]) + " |")
    noise, pooled = (
        [rep.get(k, {}).get(m, float("nan")) for m in VERDICT_METRICS]
        for k in ("evaluation_noise", "pooled_sd")
    )
    return lines + [
        "",
        "\\* if more seeds kept today's mean and spread of the paired differences (a planning figure,",
        "not a result: the next seeds move both).",
        "Evaluation noise alone, per paired seed (from the noise seeds' disagreement): strict "
        f"{noise[0]:.4f}, per image {noise[1]:.4f}; pooled SD of the paired differences: {pooled[0]:.3f} and "
        f"{pooled[1]:.3f}.",
        "The 95 % intervals make no adjustment for the looks that gave arms more seeds (docs/benchmarks.md,",
        '"Sequential looks").',
    ]


def claim_lines(rep: dict) -> list[str]:
    """The claims table: each paper claim, its arm, n, the primary difference with its 95 % interval
    (the non-inferiority rule reads its lower bound against −0.02) and the verdict."""
    lines = ["| claim | arm | n | held-out strict, 95 % | verdict |", "|---|---|---|---|---|"]
    for c in rep["claims"]:
        interval = _cell(rep["paired"][c["arm"]]["diff"]["strict/overall"])
        lines.append(f"| {c['claim']} | {_label(c['arm'], rep)} | {c['n']} | {interval} | {c['verdict']} |")
    return lines


def confirm_lines(rep: dict) -> list[str]:
    """The confirmation set's section (``rep``: :func:`skill_report` of the records' ``"confirm"``)."""
    base = rep["base"]["strict"]
    cats = [c for c in base if c not in ("overall", "per_image")]  # two_object, color_attr, position
    lines = [
        "## The confirmation set (300 prompts × 4 samples × noise seeds 7001, 7002; docs/benchmarks.md)",
        "",
        f"Base checkpoint: strict {base['overall']:.3f} (per image {base['per_image']:.3f}). Only runs",
        "scored on it count (published with their weights). Change over the base, every arm scored (not",
        "a comparison: an arm without Flow-GRPO's same seeds scored here has no paired row below):",
        "",
        "| " + " | ".join(["arm", "seeds", "strict − base", "soft − base", "strict per image", *cats]) + " |",
        "|" + "---|" * (5 + len(cats)),
    ]
    lines += change_rows(rep["arms"], cats, str)
    lines += [
        "",
        "Paired with Flow-GRPO at the same seed:",
        "",
        "| " + " | ".join(["arm", "seeds", "strict", "strict per image", *cats]) + " |",
        "|" + "---|" * (4 + len(cats)),
    ]
    for arm, p in rep["paired"].items():
        d = p["diff"]
        row = [arm, ",".join(map(str, p["seeds"])), _cell(d["strict/overall"]), _cell(d["strict/per_image"])]
        lines.append("| " + " | ".join([*row, *(_cell(d[f"strict/{c}"]) for c in cats)]) + " |")
    return [*lines, "", *verdict_lines(rep), "", *claim_lines(rep)]


def arm_costs(records: dict[str, dict]) -> dict[str, dict]:
    """Per arm: the seed means of :func:`run_cost` over its published runs that carry a curve."""
    per_arm: dict[str, list[dict]] = {}
    for name, rec in records.items():
        if "-seed" in name and rec.get("curve") and "config" in rec:
            per_arm.setdefault(name.rsplit("-seed", 1)[0], []).append(run_cost(rec))
    return {
        arm: {"n": len(costs), **{k: sum(c[k] for c in costs) / len(costs) for k in costs[0]}}
        for arm, costs in sorted(per_arm.items())
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", help="the directory holding runs/ (published JSON)")
    args = p.parse_args()
    out = Path(args.results)
    records = {f.stem: json.loads(f.read_text()) for f in sorted((out / "runs").glob("*.json"))}
    categories = {m["prompt"]: m["category"] for m in load_prompts("test")}
    rep = skill_report(records, categories)
    rep["cost"] = arm_costs(records)
    if "confirm" in records.get("base-heldout", {}) and any("confirm" in r for r in records.values()):
        confirm = {m["prompt"]: m["category"] for m in load_prompts("confirm")}
        rep["confirm"] = skill_report(records, confirm, evaluation="confirm")
    (out / "results.json").write_text(json.dumps(rep, indent=1) + "\n")
    gpu = any(str(r.get("config", {}).get("device", "")).startswith("cuda") for r in records.values())
    timed = out / "iteration_times.json"  # speed/skill_rate.py --arms ... --out, on a quiet machine
    times = json.loads(timed.read_text()) if timed.is_file() else None
    (out / "table.md").write_text(table(rep, gpu, times) + "\n" + "\n".join(progress(out)))
    figures.figure(rep, out / "compare.png")
    figures.curves(records, out / "curves.png")
    figures.heldout_vs_nfe(rep, records, out / "heldout_vs_nfe.png")
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
