"""Let the background skill grid yield the CPU: pause it (SIGSTOP) while other work uses the CPU, and
continue it (SIGCONT) once the machine has been quiet for a minute.

Measured on the 2-core machine: a 2-thread torch job beside the grid's 2-thread run ran 20× slower
(139 s against about 7 s), with or without ``nice 19`` on every grid thread. So the grid must stop,
not merely lower its priority, whenever a test suite, a CI run or a benchmark starts; this watcher does
it without anyone remembering to ``skill_grid_bg.sh pause``.

    python benchmarks/skill_grid/grid_yield.py LEADER_PID [--busy 0.5] [--quiet_s 60] [--every 5]

The grid is every descendant of ``LEADER_PID`` (``skill_grid_bg.sh run``); everything else counts as
other work. It reads ``/proc`` only (Linux) and exits when the leader does, or on SIGTERM, continuing what
it paused. A grid stopped by hand (``skill_grid_bg.sh pause``, which stops this watcher too) is left alone.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def read_processes() -> dict[int, tuple[int, int, str]]:
    """``pid → (ppid, utime + stime in clock ticks, state)`` of every process readable now."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may hold spaces
        out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), fields[0])
    return out


def descendants(procs: dict[int, tuple[int, int, str]], root: int) -> set[int]:
    """``root`` and every process below it, but not this watcher."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found - {os.getpid()}


def other_cores(before: dict, after: dict, grid: set[int], seconds: float, tick: float) -> float:
    """Cores used by processes outside ``grid`` (and not this watcher) between the two reads."""
    used = 0
    for pid, (_, ticks, _) in after.items():
        if pid in grid or pid == os.getpid():
            continue
        used += max(ticks - before[pid][1], 0) if pid in before else ticks
    return used * tick / seconds


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def signal_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("leader", type=int, help="pid of the grid's leader (skill_grid_bg.sh run)")
    ap.add_argument("--busy", type=float, default=0.5, help="other work's cores that pause the grid")
    ap.add_argument("--quiet_s", type=float, default=60, help="seconds under busy/4 before it continues")
    ap.add_argument("--every", type=float, default=5, help="seconds between two reads of /proc")
    ap.add_argument("--dry", action="store_true", help="print the other work's load, signal nothing")
    args = ap.parse_args(argv)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stopped with the grid: continue what it paused
    paused, quiet_since = False, None
    before, t0 = read_processes(), time.monotonic()
    try:
        while args.leader in before:
            time.sleep(args.every)
            after, t1 = read_processes(), time.monotonic()
            grid = descendants(after, args.leader)
            load = other_cores(before, after, grid, t1 - t0, tick)
            paused = paused and any(after[p][2] == "T" for p in grid)  # not if continued by hand
            if args.dry:
                say(f"other work: {load:.2f} cores; grid: {len(grid)} processes")
            elif not paused and load > args.busy and not any(after[p][2] == "T" for p in grid):
                signal_all(grid, signal.SIGSTOP)  # (a grid stopped by hand is left to whoever stopped it)
                paused, quiet_since = True, None
                say(f"paused: other work uses {load:.2f} cores")
            elif paused and load < args.busy / 4:
                quiet_since = quiet_since or t1
                if t1 - quiet_since >= args.quiet_s:
                    signal_all(grid, signal.SIGCONT)
                    paused = False
                    say(f"continued: quiet for {args.quiet_s:.0f} s")
            elif paused:
                quiet_since = None
            before, t0 = after, t1
    finally:
        if paused:
            signal_all(descendants(read_processes(), args.leader), signal.SIGCONT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
