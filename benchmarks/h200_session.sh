#!/usr/bin/env bash
# One H200 session: the GPU test suite, then the benchmark against the peers (relgen bench), in the order that
# keeps the most important numbers if the session's time runs out. Usage (repo root, on the GPU machine):
#   bash benchmarks/h200_session.sh OUT_DIR [TEST_SECONDS] [BENCH_SECONDS]
# Writes OUT_DIR/gpu_tests.log, gpu_figures.jsonl (memory figures), gpu.txt and bench/attention.{json,md,png}.
set -u
out=${1:?output folder}
test_s=${2:-200}
bench_s=${3:-270}
mkdir -p "$out/bench"
export PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT="$out/gpu_figures.jsonl"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$out/gpu.txt"

timeout "$test_s" python3 -m pytest -q -n 8 tests/test_gpu.py -p no:warnings -p no:cacheprovider -rfE \
    > "$out/gpu_tests.log" 2>&1
echo "tests exit $?" >> "$out/gpu_tests.log"

# relgen and the uncompiled peers at two lengths first, then the torch.compile peers at 8K
first=$((bench_s * 2 / 5))
python3 -m relgen.bench --out "$out/bench" --seq-lens 512,8192 --systems relgen,sdpa_plain,sdpa,eager \
    --process-per group --timeout 60 --budget-s "$first" > "$out/bench.log" 2>&1
python3 -m relgen.bench --out "$out/bench" --seq-lens 8192 --systems flex_decomp,flex,compiled \
    --flex-mode default --process-per group --timeout 60 --budget-s $((bench_s - first - 10)) --resume \
    >> "$out/bench.log" 2>&1
echo "bench exit $?" >> "$out/bench.log"
