"""benchmarks/skill_grid/grid_yield.py: which processes are the grid, and how many cores the others used, from
hand-made ``/proc`` reads; and one real read of this process's own tree."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "skill_grid" / "grid_yield.py"
spec = importlib.util.spec_from_file_location("grid_yield", SCRIPT)
grid_yield = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid_yield)

# pid → (ppid, ticks, state): 10 leads the grid (11, 12 below it; 13 below 12); 20 and 21 are others
PROCS = {1: (0, 5, "S"), 10: (1, 0, "S"), 11: (10, 100, "R"), 12: (10, 3, "S"), 13: (12, 50, "R")}
PROCS |= {20: (1, 40, "R"), 21: (20, 7, "S")}


def test_the_grid_is_the_leaders_tree():
    assert grid_yield.descendants(PROCS, 10) == {10, 11, 12, 13}
    assert grid_yield.descendants(PROCS, 12) == {12, 13}
    assert grid_yield.descendants(PROCS, 99) == set()  # the leader has ended


def test_the_watcher_is_never_part_of_the_grid():
    me = os.getpid()
    assert grid_yield.descendants(PROCS | {me: (11, 0, "R")}, 10) == {10, 11, 12, 13}


def test_other_cores_count_ticks_outside_the_grid_only():
    after = dict(PROCS)
    after[11] = (10, 100 + 400, "R")  # the grid's 4 s: not counted
    after[20] = (1, 40 + 150, "R")  # another process: 1.5 s
    after[30] = (1, 50, "R")  # started since the last read: all its 0.5 s
    del after[21]  # ended since the last read: nothing
    grid = grid_yield.descendants(after, 10)
    # 2.0 s of CPU in 4 s of wall clock at 100 ticks per second: half a core
    assert grid_yield.other_cores(PROCS, after, grid, seconds=4.0, tick=0.01) == pytest.approx(0.5)


def test_a_real_read_finds_a_child_below_this_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        procs = grid_yield.read_processes()
        assert procs[child.pid][0] == os.getpid() and procs[child.pid][2] in "RSD"
        assert child.pid in grid_yield.descendants(procs, os.getpid())
    finally:
        child.kill()
        child.wait()
