"""Mutation check of the training glue (issue 28): does the test suite fail when the loop is wrong?

Each mutant (``mutant_catalogue/``) is one semantic bug, written as an exact edit of one line of
``flowcredit/`` (the update, the values, ψ, the KL term, EMA, resume, export and the credit
functions). The script
copies the working tree to a temporary directory, checks that the chosen tests pass there unmutated,
then applies one mutant at a time, runs the tests that should catch it (``pytest -x``), and reports
which test killed it, or that it survived. The working tree itself is never edited.

    .venv/bin/python benchmarks/mutants/mutants.py         # all; writes benchmarks/results/mutants.{json,md}
    .venv/bin/python benchmarks/mutants/mutants.py --only adv_sign_in_update,kl_sign

Every test named here is part of ``make test``, so a mutant killed here is killed by ``make test``.
Runs in about 7.5 minutes on a 2-core AMD EPYC (73 mutants); `--only A,B --merge` reruns some
and updates their rows of the report. The report's head says when, on which CPU and in how long the
last full run ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from mutant_catalogue import MUTANTS, Mutant  # beside this script
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (no .venv, no runs)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def run_tests(root: Path, tests: list[str], timeout: float) -> tuple[int, str, float]:
    """``pytest -x`` on ``tests`` in ``root`` (its flowcredit/ shadows the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout} s\n{exc.stdout or ''}", time.perf_counter() - t0


def check_in(root: Path, m: Mutant) -> str:
    text = (root / m.path).read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: its text occurs {text.count(m.old)} times in {m.path} (want 1)")
    return text


def run_mutant(root: Path, m: Mutant, timeout: float) -> dict:
    """Apply ``m``, run its tests, restore the file; a row of the report."""
    original = check_in(root, m)
    (root / m.path).write_text(original.replace(m.old, m.new))
    try:
        code, out, seconds = run_tests(root, list(m.tests), timeout)
    finally:
        (root / m.path).write_text(original)
    killers = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    status = {0: "survived", 1: "killed"}.get(code, "error")
    row = {**asdict(m), "status": status, "killed_by": killers, "seconds": round(seconds, 1)}
    if status == "error":
        row["output_tail"] = out[-2000:]
    return row


def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s "Model name", from /proc/cpuinfo) and its core count."""
    try:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        names = []
    return f"{(names or [platform.processor() or 'unknown CPU'])[0].strip()}, {os.cpu_count()} cores"


def run_line(seconds: float, only: list[str] | None = None) -> str:
    """When, where and how long: ``Full run: …`` or, for ``--merge``, ``Rerun of a, b: …``."""
    head = f"Rerun of {', '.join(only)}" if only else "Full run"
    return f"{head}: {time.strftime('%Y-%m-%d %H:%M %Z')} on {cpu_name()}, {seconds:.0f} s."


def write_report(rows: list[dict], out: Path, notes: tuple[str, ...] = ()) -> None:
    """``mutants.json`` (the rows) and ``mutants.md``; ``notes``: paragraphs under the count (when,
    where, how long; a merge keeps the last full run's and the reruns' since)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.json").write_text(json.dumps(rows, indent=1) + "\n")
    killed = sum(r["status"] == "killed" for r in rows)
    lines = [
        "# Mutation check of the training glue",
        "",
        f"`benchmarks/mutants/mutants.py`: {killed} of {len(rows)} mutants killed. "
        "Each row is one semantic bug",
        "applied alone to a copy of the tree; *killed by* is the first test that failed (`pytest -x`).",
        "",
        *(x for note in notes for x in (note, "")),
        "| mutant | area | file | bug | result | killed by | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = "<br>".join(f"`{k}`" for k in r["killed_by"]) or "—"
        cells = [r["name"], r["area"], r["path"], r["bug"], r["status"], by, r["seconds"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    (out / "mutants.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma list of mutant names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="report folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated pass of the tests")
    ap.add_argument("--merge", action="store_true", help="with --only: update these rows of the report")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants {sorted(unknown)}")
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        for m in chosen:
            check_in(root, m)
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            code, out, seconds = run_tests(root, tests, 3 * args.timeout)
            if code != 0:
                print(out[-4000:])
                raise SystemExit(f"the unmutated tree fails its tests (exit {code}): fix that first")
            print(f"baseline: the {len(tests)} test targets pass unmutated ({seconds:.0f} s)")
        rows = [run_mutant(root, m, args.timeout) for m in tqdm(chosen, desc="mutants", file=sys.stdout)]
    for r in rows:
        print(f"{r['status']:>8}  {r['name']:<36} {', '.join(r['killed_by'][:1])}")
    survivors = [r["name"] for r in rows if r["status"] != "killed"]
    print(
        f"{len(rows) - len(survivors)} of {len(rows)} killed"
        + (f"; not killed: {survivors}" if survivors else "")
    )
    seconds = time.perf_counter() - t_start
    if not args.only:
        write_report(rows, Path(args.out), (run_line(seconds),))
    elif args.merge:  # replace or add these rows, keep the others, in MUTANTS order
        old = {r["name"]: r for r in json.loads((Path(args.out) / "mutants.json").read_text())}
        old |= {r["name"]: r for r in rows}
        md = Path(args.out) / "mutants.md"
        lines = md.read_text().splitlines() if md.exists() else []
        notes = (  # the last full run's line, the reruns since (each rerun's line kept), this one
            *[x for x in lines if x.startswith("Full run:")][:1],
            *[x for x in lines if x.startswith("Rerun of ")],
            run_line(seconds, [r["name"] for r in rows]),
        )
        write_report([old[m.name] for m in MUTANTS if m.name in old], Path(args.out), notes)
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
