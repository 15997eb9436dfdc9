"""What ``flowcredit bench`` reads back from a finished run folder: its evaluation points with the
cumulative seconds and network calls (NFE) spent to reach them, its per-iteration costs and per-category
scores; and the strict-JSON form of the results it writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

from flowcredit.run.runlog import read_iteration_seconds, read_metrics


def read_run(run_dir: Path) -> dict:
    """Evaluation points of one run with cumulative seconds and NFE, plus its per-iteration costs."""
    secs = read_iteration_seconds(run_dir)
    seconds, nfe, points, costs, floor, train_floor = 0.0, 0, [], [], math.nan, math.nan
    categories = {"start": {}, "final": {}}
    for m in read_metrics(run_dir):
        it = m["iteration"]
        if it > 0:
            seconds += secs.get(it, math.nan)
            cost = [m.get(f"nfe/{k}", 0) for k in ("rollout", "values", "train")]
            costs.append(cost)
            nfe += sum(cost)
        floor = m.get("eval/test/floor_soft", floor)
        train_floor = m.get("eval/train/floor_soft", train_floor)
        if "eval/test/soft" in m:
            soft, strict = m["eval/test/soft"], m.get("eval/test/strict", math.nan)  # NaN: no pass/fail
            points.append({"iteration": it, "seconds": seconds, "nfe": nfe, "soft": soft, "strict": strict})
            if "eval/train/soft" in m:
                points[-1]["train"] = m["eval/train/soft"]
            cats = {k.split("/")[2]: v for k, v in m.items() if _is_category(k)}
            categories["final" if len(points) > 1 else "start"] = cats
    iters = max(len(costs), 1)
    bench = json.loads((run_dir / "bench.json").read_text()) if (run_dir / "bench.json").exists() else {}
    wall = math.nan if bench.get("resumed", True) else bench["wall_s"]  # a resumed run's wall is partial
    nfe_it = [sum(c[k] for c in costs) / iters for k in range(3)]
    out = dict(run_dir=str(run_dir), iterations=len(costs), seconds=seconds, setup_seconds=wall - seconds)
    out |= {"nfe_per_iteration": nfe_it, "noise_floor": floor, "train_floor": train_floor, "points": points}
    return out | {"categories_start": categories["start"], "categories_final": categories["final"]}


def _is_category(key: str) -> bool:
    """``eval/test/<category>/soft`` (the trainer's per-category held-out keys)."""
    parts = key.split("/")
    return len(parts) == 4 and parts[:2] == ["eval", "test"] and parts[3] == "soft"


def json_safe(obj):
    """NaN → null, so that results.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
