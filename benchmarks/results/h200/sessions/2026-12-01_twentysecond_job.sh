#!/bin/bash
# Twenty-second session, one nvidia-h200-x2 call: GPU 0 runs the GPU suite on the tree with the unspecialised
# dropout seed and the tensor seed (tests/test_gpu.py, test_features.py, test_compile.py, among them dropout
# replayed from CUDA graphs bit for bit against eager calls); GPU 1 times dropout steps with a new seed per call:
# eager (int seed), torch.compile (int seed) and torch.compile's CUDA graphs (the tensor seed updated in place).
# Each job pinned to half the cores. Started after the usual pydantic prefix, with OUT set by the device tool.
set -u
(export CUDA_VISIBLE_DEVICES=0; VERIFY_S=${VERIFY_S:-540} taskset -c 0-15 \
    bash benchmarks/h200_session.sh verify "$OUT/verify" > "$OUT/verify.out" 2>&1) &
(export CUDA_VISIBLE_DEVICES=1; timeout "${BENCH_S:-540}" taskset -c 16-31 \
    python3 benchmarks/compiled_calls.py --dropout 0.1 --specs "${SPECS:-t5,deberta_v3}" \
    --seq-lens "${LENS:-128,512,1024}" --out "$OUT/compiled_calls_dropout.jsonl" > "$OUT/compiled_calls.log" 2>&1) &
wait
tail -3 "$OUT/verify/gpu_tests.log"; grep -E "FAILED|ERROR" "$OUT/verify/gpu_tests.log" | head -20
grep -c '"ms"' "$OUT/compiled_calls_dropout.jsonl"; grep -h error "$OUT/compiled_calls_dropout.jsonl" | cut -c1-900
python3 benchmarks/compiled_calls.py --report "$OUT/compiled_calls_dropout.jsonl"
