#!/usr/bin/env bash
# The skill grid on the CPU, in the order of its issue (docs/benchmarks.md, "The skill comparison"):
# DenseGRPO with one-step values ×4, Stepwise ×4, TP-GRPO at equal NFE seed 13, DenseGRPO with ODE
# values ×4 (issue 56: first), then issue 60's methods ×2, one arm's two seeds after the other, cheapest
# first (claims pre-registered in docs/benchmarks.md; moved ahead on 2026-12-06, session 27, once issue 56
# closed: they are the open issue's last item) and seeds 12–13 of each whose mean at n = 2 was at least
# −0.01 (the rule fixed with their claims), then DenseGRPO's credit rule and its sampler apart ×2,
# seeds 14–17 (Flow-GRPO, TP-GRPO, and each new arm still inconclusive), then the newer methods ×2 as a
# CPU cross-check (issue 39: their first look ran on a GPU on 2026-12-04,
# benchmarks/results/skill_compare_gpu; GPU and CPU runs are never pooled). Resumable: finished runs
# are read from the published JSON, unfinished ones resume from their checkpoints (restore parked
# ones first: benchmarks/skill_grid/skill_grid_park.py restore).
#   bash benchmarks/skill_grid/skill_grid.sh [PUBLISH_DIR]  # one 2-thread run at a time; pause it around other
#                                                          # torch work (skill_grid_bg.sh runs it and pauses it itself)
set -euo pipefail
PUBLISH=${1:-benchmarks/results/skill_compare/runs}
PY=${PY:-.venv/bin/python}
bench() {  # ARMS SEEDS
    "$PY" -m flowcredit bench --task skill --presets skill --ablations "$1" --seeds "$2" --jobs 1 --threads 2 \
        --out runs/skill_compare --publish "$PUBLISH"
}
bench dense_euler1 10,11,12,13
bench stepwise 10,11,12,13
bench tp_equal_nfe 13
bench dense 10,11,12,13   # DenseGRPO as published: first in the third round (issue 56)
bench dense_euler1_cps 10   # parked at 352 / 450 when issue 60's arms moved ahead
# issue 60: claims pre-registered before any run; an arm's verdict needs both of its seeds
bench dgpo_quarter 10,11
bench coca 10,11
bench dppo 10,11
bench g2rpo 10,11
bench flash 10,11
bench tree 10,11
bench branch 10,11
bench coca 12,13   # its mean at n = 2 was at least −0.01 (+0.006): seeds 12–13 by the rule
bench dppo 12,13   # its mean at n = 2 was at least −0.01 (+0.006): seeds 12–13 by the rule
bench g2rpo 12,13   # its mean at n = 2 was at least −0.01 (−0.0096): seeds 12–13 by the rule
bench tree 12,13   # its mean at n = 2 was at least −0.01 (−0.002): seeds 12–13 by the rule
bench branch 12,13   # its mean at n = 2 was at least −0.01 (+0.016): seeds 12–13 by the rule
bench dense_euler1_cps,dance_psi 10,11   # which of dense_euler1's two changes costs the score
bench tp 14,15,16,17
# seeds 14–17 for each new arm whose primary verdict is still inconclusive at n = 4 (issue 37's rule)
more=$("$PY" benchmarks/skill_grid/skill_grid_plan.py --straddling dense_euler1,stepwise,dense,tp_equal_nfe \
    --published "$PUBLISH") || { echo "skill_grid: no verdicts read; seeds 14-17 of the new arms skipped" >&2; more=; }
if [ -n "$more" ]; then bench "$more" 14,15,16,17; fi
bench mixgrpo,tempflow,egrpo,grpo_guard,nft_quarter,awm_quarter 10,11   # issue 39, on the CPU
