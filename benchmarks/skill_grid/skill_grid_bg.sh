#!/usr/bin/env bash
# The CPU skill grid in the background, from a pinned worktree, so that editing this checkout never
# changes the code a run is halfway through (docs/benchmarks.md, "The skill comparison"):
#   bash benchmarks/skill_grid/skill_grid_bg.sh start [WORKTREE] # worktree at HEAD (made if missing), parked runs
#                                                                # restored, the grid and a park loop started
#   bash benchmarks/skill_grid/skill_grid_bg.sh pause | cont     # SIGSTOP / SIGCONT by hand (grid_yield.py, beside this,
#                                                                # also pauses it while other work uses the CPU)
#   bash benchmarks/skill_grid/skill_grid_bg.sh status           # the current run's last progress line
#   bash benchmarks/skill_grid/skill_grid_bg.sh plan             # every run: published, parked or to run; hours left
#   bash benchmarks/skill_grid/skill_grid_bg.sh park             # park the unfinished runs now (the loop does it every 20 min)
#   bash benchmarks/skill_grid/skill_grid_bg.sh stop             # end the grid, park its unfinished runs
# Finished runs are published into this checkout's benchmarks/results/skill_compare/runs and unfinished
# ones parked into .../inflight every 20 minutes: commit both before the machine stops. The grid runs
# in a process group of its own (WORKTREE/grid.pgid), which pause, cont and stop signal.
set -euo pipefail
cd "$(dirname "$0")/../.."
MAIN=$PWD
WORKTREE=${2:-${SKILL_GRID_WORKTREE:-/work/grid}}
RESULTS=${SKILL_GRID_RESULTS:-$MAIN/benchmarks/results/skill_compare}
PY=$MAIN/.venv/bin/python

in_tree() { # in_tree NAME: the worktree's copy of this folder's NAME (benchmarks/NAME in a worktree of
    # a commit before benchmarks/skill_grid/ existed)
    if [ -f "$WORKTREE/benchmarks/skill_grid/$1" ]; then echo "benchmarks/skill_grid/$1"; else echo "benchmarks/$1"; fi
}

park() {
    (cd "$WORKTREE" && PYTHONPATH=$WORKTREE nice -n 10 "$PY" "$(in_tree skill_grid_park.py)" park \
        runs/skill_compare/runs "$RESULTS/inflight")
}

group() { # group SIGNAL: the grid's whole process group, if it runs
    local pgid
    pgid=$(cat "$WORKTREE/grid.pgid" 2>/dev/null) || return 0
    kill -"$1" -- "-$pgid" 2>/dev/null || true
}

case "${1:-status}" in
start)
    if [ -f "$WORKTREE/grid.pgid" ] && kill -0 -- "-$(cat "$WORKTREE/grid.pgid")" 2>/dev/null; then
        echo "the grid runs already (process group $(cat "$WORKTREE/grid.pgid"))"
        exit 1
    fi
    [ -d "$WORKTREE" ] || git worktree add -q --detach "$WORKTREE" HEAD
    mkdir -p "$WORKTREE/runs/skill_compare/runs"
    restored=$(cd "$WORKTREE" && PYTHONPATH=$WORKTREE "$PY" "$(in_tree skill_grid_park.py)" restore \
        runs/skill_compare/runs "$RESULTS/inflight")
    if [ -f "$WORKTREE/grid.log" ]; then mv "$WORKTREE/grid.log" "$WORKTREE/grid.prev.log"; fi
    setsid nohup bash "$0" run "$WORKTREE" >/dev/null 2>&1 &
    # printed after the launch: a reader that stops early (| head) cannot stop the start
    echo "grid code: $(git -C "$WORKTREE" log --oneline -1)"
    echo "$restored"
    echo "started; log: $WORKTREE/grid.log"
    ;;
run) # the process group's leader: the park loop beside the grid, one last park after it
    echo $$ >"$WORKTREE/grid.pgid"
    (while sleep 1200; do park >>"$WORKTREE/park.log" 2>&1 || true; done) &
    "$PY" "$MAIN/benchmarks/skill_grid/grid_yield.py" $$ >>"$WORKTREE/yield.log" 2>&1 & # paused while others run
    (cd "$WORKTREE" && PY=$PY PYTHONPATH=$WORKTREE nice -n 5 bash "$(in_tree skill_grid.sh)" "$RESULTS/runs" \
        >grid.log 2>&1) || true
    park >>"$WORKTREE/park.log" 2>&1 || true
    kill %1 %2 2>/dev/null || true
    ;;
pause) group STOP ;;
cont) group CONT ;;
status)
    tr '\r' '\n' <"$WORKTREE/grid.log" | grep -a "bench:\|it/s\|s/it" | tail -2
    tail -1 "$WORKTREE/yield.log" 2>/dev/null || true
    ;;
plan) "$PY" benchmarks/skill_grid/skill_grid_plan.py --worktree "$WORKTREE" ;;
park) park ;;
stop)
    group CONT
    group TERM
    sleep 3
    park
    echo "stopped; commit benchmarks/results/skill_compare (runs/ and inflight/)"
    ;;
*)
    sed -n 2,13p "$0"
    exit 2
    ;;
esac
