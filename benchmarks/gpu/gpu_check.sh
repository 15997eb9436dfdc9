#!/usr/bin/env bash
# The GPU check, run from the repository root on a machine with one CUDA GPU and no network:
#   bash benchmarks/gpu/gpu_check.sh
# 1. installs diffusers from .gpuwheels/ (pip; if pip refuses, the wheel is unpacked onto PYTHONPATH;
#    missing pure-python dependencies come from .gpuwheels/deps/ the same way),
# 2. prints nvidia-smi and the library versions,
# 3. runs the diffusers adapter tests on CUDA (FLOWCREDIT_TEST_DEVICE=cuda; the trainer tests always
#    use CUDA when it is there),
# 4. runs benchmarks/gpu/gpu_throughput.py (SD3.5-Medium-sized random pipeline).
# Every step runs even if an earlier one failed; the exit codes are summarised at the end and the script
# exits with the largest. Output: $OUT/gpu_check.log (everything) and $OUT/gpu_throughput.json.
set -o pipefail
cd "$(dirname "$0")/../.." || exit 1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
SITE=/tmp/gpu_check_site # fallback install target, put on PYTHONPATH
export PYTHONPATH=$PWD:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 FLOWCREDIT_TEST_DEVICE=cuda
SUMMARY=()

step() { # step NAME COMMAND...: run it, print and remember its exit code, never stop the script
    local name=$1 start=$SECONDS rc
    shift
    echo -e "\n===== $name: $*"
    "$@"
    rc=$?
    echo "===== $name: exit $rc after $((SECONDS - start)) s"
    SUMMARY+=("$name=$rc")
    return 0
}

install_diffusers() { # a machine that already has diffusers (pip install -e ".[diffusers]") skips this
    python3 -c "import diffusers" 2>/dev/null && return 0
    python3 -m pip install --no-deps --no-index .gpuwheels/diffusers-*.whl && return 0
    echo "pip install failed: unpacking the wheel into $SITE instead"
    python3 -m zipfile -e .gpuwheels/diffusers-*.whl "$SITE"
}

fill_missing_deps() { # unpack a fallback wheel for each pure-python dependency that does not import
    local wheel module
    for wheel in .gpuwheels/deps/*.whl; do
        module=$(basename "$wheel" | cut -d- -f1)
        python3 -c "import $module" 2>/dev/null || {
            echo "unpacking $wheel"
            python3 -m zipfile -e "$wheel" "$SITE"
        }
    done
    python3 -c "import diffusers; print('diffusers', diffusers.__version__, 'imports')"
}

versions() {
    python3 - <<'EOF'
import importlib
import sys

print("python", sys.version.replace("\n", " "))
for name in ("torch", "transformers", "peft", "diffusers", "accelerate", "huggingface_hub", "tokenizers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as exc:
        print(name, "IMPORT FAILED:", repr(exc))
import torch

print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.device_count(), "device(s)")
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
}

main() {
    echo "gpu_check: $(date -u) in $PWD, OUT=$OUT"
    step install install_diffusers
    step import fill_missing_deps
    step nvidia-smi nvidia-smi
    step versions versions
    step adapter-tests timeout 240 python3 -m pytest -q -x -rs --durations=10 -p no:cacheprovider \
        tests/test_adapters_diffusers.py tests/test_adapters_diffusers_text.py
    step throughput timeout 300 python3 benchmarks/gpu/gpu_throughput.py --json "$OUT/gpu_throughput.json"
    echo -e "\n===== summary (exit codes; 124 = timed out): ${SUMMARY[*]}"
    local worst=0 item
    for item in "${SUMMARY[@]}"; do
        ((${item##*=} > worst)) && worst=${item##*=}
    done
    return "$worst"
}

main 2>&1 | tee "$OUT/gpu_check.log"
