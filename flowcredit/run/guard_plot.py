"""``guard_curve.png``: what the reward-hacking guard measured at each evaluation of a run (docs/guard.md)."""

from __future__ import annotations

from pathlib import Path

from flowcredit.run.runlog import read_metrics

ARTEFACTS = {
    "diversity": "diversity",
    "saturation": "saturation",
    "high_freq": "high-frequency share",
}
"""The signals drawn relative to their start value, and their labels."""


def plot_guard(run_dir: Path) -> Path:
    """Two panels over the evaluations: the trained reward and every monitor (left), the diversity and
    artefact signals as a ratio to their start with the colour histogram's drift and the weight drift
    (right); red dashes mark alarms, green circles the evaluations ``best/`` was taken at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_metrics(run_dir) if "guard/trained" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5), dpi=110)
    names = sorted(
        {k[6:] for r in rows for k in r if k.startswith("guard/") and "/" not in k[6:]} - _NOT_SCORES
    )
    for name in ["trained", *[n for n in names if n != "trained"]]:
        points = [(r["iteration"], r[f"guard/{name}"]) for r in rows if f"guard/{name}" in r]
        left.plot(*zip(*points), "o-", ms=3, label="trained reward" if name == "trained" else name)
        best = [(r["iteration"], r[f"guard/{name}"]) for r in rows if r.get("guard/best")]
        if best and name == "trained":
            left.plot(*zip(*best), "o", mfc="none", mec="green", ms=9, label="best/ taken")
    for key, label in ARTEFACTS.items():
        start = rows[0].get(f"guard/{key}") if rows else None
        if start:
            right.plot([r["iteration"] for r in rows], [r[f"guard/{key}"] / start for r in rows], label=label)
    for key, label in (("histogram_tv", "colour drift (TV)"), ("drift", "weight drift")):
        if rows and f"guard/{key}" in rows[0]:
            right.plot([r["iteration"] for r in rows], [r[f"guard/{key}"] for r in rows], "--", label=label)
    for ax, title in ((left, "held-out rewards (ODE, fixed noise)"), (right, "signals (ratio to start)")):
        for k, it in enumerate(r["iteration"] for r in rows if r.get("guard/alarm")):
            ax.axvline(it, color="red", ls="--", lw=0.8, alpha=0.7, label="alarm" if k == 0 else None)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(run_dir) / "guard_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out


_NOT_SCORES = {*ARTEFACTS, "histogram_tv", "drift", "alarm", "best", "rollback", "stop"}
