#!/usr/bin/env bash
# The powered comparison on one CUDA GPU (the tiny model on CUDA, many runs at once):
#   bash benchmarks/gpu/gpu_bench.sh [SEEDS] [JOBS]
# 1. a smoke run (one quick iteration on CUDA) that stops the script early if the device path is broken;
# 2. flowcredit bench --task compare over SEEDS (default 0..7) with JOBS runs at once (default 16):
#    the four presets and their one-step-value rows;
# 3. the confound checks on the same seeds, in the same bench (finished rows are read, not rerun):
#    flow_grpo / tp_grpo with β = 0.04 (Flow-GRPO's KL) and with every window step accumulated into
#    one optimizer step; stepwise_grpo with shared initial noise and with centred gains; dense_grpo
#    without calibration.
# Every 20 s the finished runs' small files go to $OUT/runs.tgz, so a run cut off by the time limit
# still returns what finished; `flowcredit bench … --report_only` rebuilds the tables from them.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
SEEDS=${1:-0,1,2,3,4,5,6,7}
JOBS=${2:-16}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
COMMON=(--task compare --seeds "$SEEDS" --jobs "$JOBS" --device cuda --threads 1)

pack() { # the small files of every run (no checkpoints, no images)
    tar czf "$OUT/runs.tgz.tmp" --exclude='checkpoint*' --exclude='*.png' --exclude='tb' --exclude='final' \
        runs/bench-gpu* 2>/dev/null
    mv "$OUT/runs.tgz.tmp" "$OUT/runs.tgz"
}
( while true; do sleep 20; pack; done ) &
PACKER=$!

echo "gpu_bench: $(date -u) seeds $SEEDS, $JOBS jobs"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 120 python3 -m flowcredit bench --quick --presets tp_grpo --no_cheap --seeds 0 --iterations 1 \
    --device cuda --threads 1 --out runs/smoke || { echo "SMOKE FAILED"; kill $PACKER; exit 1; }
bench() { # bench NAME ARGS...: one bench into runs/NAME, timed
    local name=$1 t0=$SECONDS
    shift
    python3 -m flowcredit bench "${COMMON[@]}" --out "runs/$name" "$@" 2>&1 | grep -v ": done in"
    echo "===== $name: exit $? after $((SECONDS - t0)) s"
}
bench bench-gpu                                                          # the rows of the comparison
bench bench-gpu --ablations shared_noise,centred,uniform_noise,beta,accum # + the confound checks
kill $PACKER
pack
ls -la "$OUT"
