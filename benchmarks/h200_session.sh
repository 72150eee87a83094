#!/usr/bin/env bash
# One H200 session: the GPU test suite, then the benchmark against the peers (relgen bench).
# Usage (from the repo root, on the GPU machine):
#   bash benchmarks/h200_session.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS] [BENCH ARGS...]
# Test log, memory figures (JSON lines) and the benchmark's attention.json/.md/.png land in OUT_DIR.
set -u
out=${1:?output folder}
test_s=${2:-210}
bench_s=${3:-280}
shift 3 2>/dev/null || shift $#
mkdir -p "$out/bench"
export PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT="$out/gpu_figures.jsonl"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"

timeout "$test_s" python3 -m pytest -q -n 8 tests/test_gpu.py -p no:warnings -p no:cacheprovider \
    --timeout "$test_s" -rfE > "$out/gpu_tests.log" 2>&1
echo "tests exit $?" >> "$out/gpu_tests.log"

timeout "$bench_s" python3 -m relgen.bench --out "$out/bench" --budget-s $((bench_s - 20)) "$@" \
    > "$out/bench.log" 2>&1
echo "bench exit $?" >> "$out/bench.log"
