"""The skill bench's evaluations of a finished run: the held-out set and the confirmation set (issue
56; docs/benchmarks.md, "The confirmation set"), their budgets, and the scoring of published runs.

Every run the skill bench finishes is evaluated on both sets (:func:`final_eval`:
``run_dir/heldout/eval.json`` and ``run_dir/confirm/eval.json``, published as the record's ``"heldout"``
and ``"confirm"``), the base checkpoint once the same way (:func:`base_eval`). A run published with its
weights (``DEST/<run>/config.json`` and ``final/``: runs from 2026-12-06 on) but without the
confirmation evaluation is scored from those weights, training nothing: ``flowcredit bench --task skill
--publish DEST --score_confirm`` (:func:`score_published`), and every skill bench with ``--publish``
does it at its start.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from flowcredit.config import Config

FINAL_EVAL_SEEDS = (7001, 7002)
"""Noise seeds of the final held-out evaluation, used for nothing else."""
FINAL_EVAL_SAMPLES = 16
"""Samples per held-out prompt (× 86 prompts × 2 seeds = 2,752 images per run)."""
CONFIRM_PROMPTS = "confirm"
"""The confirmation set (``flowcredit/tasks/data/shapes_confirm.jsonl``: 300 prompts that overlap
neither split; :func:`flowcredit.tasks.shapes.prompts.confirmation_prompts`)."""
CONFIRM_SAMPLES = 4
"""Samples per confirmation prompt (× 300 prompts × 2 seeds = 2,400 images per run, about the held-out
evaluation's 2,752); its noise seeds are the held-out evaluation's, never used for a choice."""
CONFIRM_DIR = "confirm"
"""Where a run's confirmation evaluation lands (``run_dir/confirm/eval.json``)."""
EVAL_SETS = {
    "test": (FINAL_EVAL_SAMPLES, FINAL_EVAL_SEEDS),
    CONFIRM_PROMPTS: (CONFIRM_SAMPLES, FINAL_EVAL_SEEDS),
}
"""Prompt set → (samples per prompt, noise seeds) of a run's final evaluations."""
QUICK_EVAL = ["--max-prompts", "4", "--samples-per-prompt", "2"]
"""``bench --quick``: 4 prompts × 2 samples instead."""


def final_eval(run_dir: Path, threads: int, quick: bool = False) -> Path:
    """Evaluate ``run_dir``'s exported weights once on each set (``run_dir/heldout/eval.json`` and
    ``run_dir/confirm/eval.json``); returns the held-out file."""
    which = ["--config", str(run_dir / "config.json")]
    evaluate_on(which, run_dir / CONFIRM_DIR, threads, quick, CONFIRM_PROMPTS)
    return evaluate_on(which, run_dir / "heldout", threads, quick)


def base_which(cfg: Config) -> list[str]:
    """``flowcredit eval``'s flags for the base checkpoint of ``cfg``, on its device."""
    return ["--model", cfg.model, "--checkpoint", cfg.checkpoint, "--device", cfg.device]


def base_eval(cfg: Config, out: Path, threads: int, quick: bool = False) -> Path:
    """The base checkpoint of ``cfg`` evaluated as :func:`final_eval` (``out/eval.json``, and the
    confirmation set in ``out/confirm``); returns the held-out file."""
    path = evaluate_on(base_which(cfg), out, threads, quick)
    evaluate_on(base_which(cfg), out / CONFIRM_DIR, threads, quick, CONFIRM_PROMPTS)
    return path


def evaluate_on(which: list[str], out: Path, threads: int, quick: bool, prompts: str = "test") -> Path:
    """``flowcredit eval`` of the weights ``which`` names on the set ``prompts`` with its
    :data:`EVAL_SETS` budget into ``out/eval.json`` (kept if there already); returns that file."""
    path = out / "eval.json"
    if path.is_file():
        return path
    shutil.rmtree(out, ignore_errors=True)
    samples, seeds = EVAL_SETS[prompts]
    argv = [*which, "--reward", "shapes", "--prompts", prompts, "--seeds", ",".join(map(str, seeds))]
    argv += ["--samples-per-prompt", str(samples), "--threads", str(threads), "--out", str(out)]
    argv += QUICK_EVAL if quick else []
    log = out.parent / f"{out.name}.eval.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        code = subprocess.call([sys.executable, "-m", "flowcredit", "eval", *argv], stdout=fh, stderr=fh)
    if code or not path.is_file():
        raise SystemExit(f"bench: the evaluation of {out} on {prompts!r} failed (exit {code}); see {log}")
    return path


def whole(evaluation: dict | None, prompts: str = "test") -> bool:
    """``evaluation`` (``flowcredit eval`` JSON) is the whole final evaluation on ``prompts``, not
    ``--quick``'s nor one cut short."""
    from flowcredit.tasks.prompt_sets import read_prompts

    samples, seeds = EVAL_SETS[prompts]
    return bool(evaluation) and (
        evaluation.get("seeds") == list(seeds)
        and len(evaluation.get("sample_prompts", ())) == len(read_prompts(prompts)) * samples
    )


def base_published(dest: Path | None, quick: bool) -> bool:
    """``dest/base-heldout.json`` holds the base checkpoint's whole final evaluation (not ``--quick``'s)."""
    path = dest / "base-heldout.json" if dest else None
    if quick or path is None or not path.is_file():
        return False
    done = whole(json.loads(path.read_text()).get("heldout"))
    if done:
        print(f"bench: base-heldout: published earlier in {dest}, not recomputed", flush=True)
    return done


def relative_paths(value, root: Path):
    """``value`` (JSON) with every string that names a path under ``root`` made relative to it (a
    published run is read on other machines: ``/x/runs/skill-seed11/final`` → ``skill-seed11/final``)."""
    if isinstance(value, dict):
        return {k: relative_paths(v, root) for k, v in value.items()}
    if isinstance(value, list):
        return [relative_paths(v, root) for v in value]
    if isinstance(value, str) and Path(value).is_absolute():
        path = Path(value)
        if path.is_relative_to(root.resolve()) or path.is_relative_to(root.absolute()):
            base = root.resolve() if path.is_relative_to(root.resolve()) else root.absolute()
            return path.relative_to(base).as_posix()
    return value


def add_confirm(record_path: Path, eval_path: Path) -> Path:
    """Adds the evaluation ``eval_path`` to the published record ``record_path`` as ``"confirm"``
    (paths under the record's folder made relative, as :func:`bench_skill.publish` does)."""
    record = json.loads(record_path.read_text())
    record["confirm"] = relative_paths(json.loads(eval_path.read_text()), record_path.parent)
    tmp = record_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(record_path)
    return record_path


def score_published(dest: Path, out: Path, cfg: Config, only: tuple[str, ...] = ()) -> list[Path]:
    """Scores on the confirmation set the published records in ``dest`` that lack it (``only``: just
    these names): the base (``base-heldout.json``, ``cfg``'s model and checkpoint) and every run whose
    weights are published (``dest/<run>/config.json``, ``dest/<run>/final``), all on ``cfg.device`` with
    ``cfg.threads``. Each evaluation lands in ``out/<record>/confirm`` first (a finished one is not
    recomputed), then in its record. Returns the records completed; runs without weights stay as
    they are."""
    done = []
    for record_path in sorted(dest.glob("*.json")):
        name, record = record_path.stem, json.loads(record_path.read_text())
        if (only and name not in only) or whole(record.get("confirm"), CONFIRM_PROMPTS):
            continue
        if name == "base-heldout":
            which = base_which(cfg)
        elif (dest / name / "final" / "trainable.safetensors").is_file():
            which = ["--config", str(dest / name / "config.json"), "--device", cfg.device]
        else:
            continue
        path = evaluate_on(which, out / name / CONFIRM_DIR, cfg.threads, False, CONFIRM_PROMPTS)
        done.append(add_confirm(record_path, path))
    return done
