#!/usr/bin/env bash
# Issue 27 on one CUDA GPU (the tiny model on CUDA, many runs at once), as one prepared script:
#   bash benchmarks/gpu_skill_grid.sh [SKILL_SEEDS] [JOBS]
# 1. a smoke run (one quick skill iteration on CUDA) that stops the script if the device path is broken;
# 2. the pre-registered confirmation of the demo-task finding (docs/benchmarks.md, "The powered
#    comparison"): TP-GRPO vs Flow-GRPO, both with Flow-GRPO's KL (β 0.04, kl_mode flow_grpo), the
#    compare task, NEW seeds 16–31; the bench's paired row tp_grpo − flow_grpo is the confirmation;
# 3. the skill comparison (flowcredit bench --task skill): the preset and its six arms over
#    SKILL_SEEDS (default 10..17), each finished run evaluated on the held-out prompts (86 × 16 × noise
#    seeds 7001/7002, on CUDA like the base checkpoint) and published as small JSON into
#    $OUT/skill/runs (GPU runs: never mix them with the CPU runs of benchmarks/results/skill_compare;
#    put them in benchmarks/results/skill_compare_gpu).
# Every 20 s the small files go to $OUT/runs.tgz, so a run cut off by the time limit still returns what
# finished. Prepared on 2026-12-02 without a GPU: bash -n checked, never run.
set -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/out}
SKILL_SEEDS=${1:-10,11,12,13,14,15,16,17}
JOBS=${2:-16}
mkdir -p "$OUT/skill/runs"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
GPU=(--device cuda --threads 1 --jobs "$JOBS")

pack() { # the small files of every run (no checkpoints, no images, no exported weights)
    tar czf "$OUT/runs.tgz.tmp" --exclude='checkpoint*' --exclude='*.png' --exclude='tb' --exclude='final' \
        runs/confirm-gpu runs/skill-gpu 2>/dev/null
    mv "$OUT/runs.tgz.tmp" "$OUT/runs.tgz"
}
( while true; do sleep 20; pack; done ) &
PACKER=$!

echo "gpu_skill_grid: $(date -u) skill seeds $SKILL_SEEDS, $JOBS jobs"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
timeout 300 python3 -m flowcredit bench --task skill --presets skill --quick --seeds 0 --iterations 1 \
    --device cuda --threads 1 --out runs/smoke-skill || { echo "SMOKE FAILED"; kill $PACKER; exit 1; }

t0=$SECONDS
python3 -m flowcredit bench --task compare --presets flow_grpo,tp_grpo --no_cheap \
    --seeds 16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31 "${GPU[@]}" \
    --beta 0.04 --kl_mode flow_grpo --out runs/confirm-gpu 2>&1 | grep -v ": done in"
echo "===== confirmation: exit $? after $((SECONDS - t0)) s"
pack

t0=$SECONDS
python3 -m flowcredit bench --task skill --presets skill --ablations tp,tp_equal_nfe,dense_euler1,stepwise,stepwise_cps,dense \
    --seeds "$SKILL_SEEDS" "${GPU[@]}" --out runs/skill-gpu --publish "$OUT/skill/runs" 2>&1 | grep -v ": done in"
echo "===== skill grid: exit $? after $((SECONDS - t0)) s"
python3 benchmarks/skill_grid_report.py "$OUT/skill" 2>&1 | tail -40  # results.json, table.md
kill $PACKER
pack
ls -la "$OUT"
