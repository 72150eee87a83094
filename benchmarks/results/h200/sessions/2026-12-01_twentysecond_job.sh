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
# Call 2 (nvidia-h200, tree 596a629: the dropout CUDA-graph test split in two, the capture probe), after the prefix:
#   P=benchmarks/results/h200/sessions/2026-12-01_twentysecond_capture_probe.py
#   for v in tensor int nodropout after_compile after_compile_reset nodropout_after_compile; do
#       (timeout 240 python3 $P $v >> $OUT/probe.jsonl 2>> $OUT/probe.err) & done; wait
#   timeout 300 python3 -m pytest -v -n 6 tests/test_compile.py tests/test_features.py \
#       -k "tensor_seed or seed_tensor or captured" -p no:warnings -rfE > $OUT/gpu_tests.log 2>&1
# Call 3 (nvidia-h200, tree 678b667: device constants made on a thread of their own):
#   the probe with tensor after_compile after_compile_reset nodropout_after_compile nodropout_after_compile_reset
#   (timeout 200 each, in parallel), then
#   RELGEN_GPU_REPORT=$OUT/gpu_figures.jsonl timeout 450 python3 -m pytest -v -n 12 tests/test_gpu.py \
#       tests/test_features.py tests/test_compile.py -p no:warnings -rfE > $OUT/gpu_tests.log 2>&1
# Call 4 (nvidia-h200, tree c110a61):
#   timeout 240 python3 -m pytest -v -n 4 tests/test_compile.py -k "first_call or compiled_cuda_graphs" \
#       -p no:warnings -rfE > $OUT/gpu_tests.log 2>&1
# Call 5 (nvidia-h200): call 6's command without `carry` (no pydantic, nothing ran; 49 s of device time lost)
# Call 6 (nvidia-h200, tree ac315d8: four draws per Philox call):
#   timeout 160 python3 -m pytest -v -n 12 tests/test_gpu.py tests/test_features.py tests/test_compile.py \
#       -k "dropout or features_long or tensor_seed or seed_tensor" -p no:warnings -rfE > $OUT/gpu_tests.log 2>&1
#   timeout 120 python3 benchmarks/results/h200/sessions/2026-12-01_twentysecond_dropout_ab.py \
#       --specs t5,deberta_v3 --seq-lens 1024 > $OUT/dropout_ab.jsonl
