# GPU 0: the three failures and the three unreached tests of the last run, a diagnosis of one failure, then
# T5's compiled peers (compiling beside them from the start) measured under max-autotune
set -u
o=$OUT/h0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
w=$(mktemp -d /tmp/h0-XXXX); cp .bench_state/attention.json $w/
PEERS="t5:1024:flex t5:512:compiled t5:1024:compiled t5:2048:flex_decomp t5:2048:flex t5:2048:compiled
t5:4096:flex_decomp t5:4096:flex t5:4096:compiled t5:8192:flex_decomp t5:8192:flex t5:8192:compiled"
WARM_END=330 source .bench_state/peers.sh
RELGEN_GPU_REPORT=$o/gpu_figures.jsonl timeout 300 python3 -m pytest -v -n 6 -p no:warnings -p no:cacheprovider -rfE \
    --tb=short "tests/test_gpu.py::test_half_precision_small[txl-1-dtype0]" \
    "tests/test_gpu.py::test_every_map_kind_on_gpu[identity]" "tests/test_gpu.py::test_every_map_kind_on_gpu[t5]" \
    "tests/test_gpu.py::test_remaining_options_in_half_precision[deberta_v3-dtype0]" \
    "tests/test_gpu.py::test_remaining_options_in_half_precision[deberta_v3-dtype1]" \
    "tests/test_gpu.py::test_remaining_options_in_half_precision[t5_decoder-dtype0]" > $o/gpu_tests.log 2>&1
echo "tests exit $? after $SECONDS s" >> $o/gpu_tests.log
timeout 200 python3 .bench_state/diag.py > $o/diag.log 2>&1
echo "diag exit $? after $SECONDS s" >> $o/diag.log
wait
for f in /tmp/warm_t5_*.log; do echo "== $f"; tail -n 5 $f; done > $o/warm.log
timeout $((548 - SECONDS)) python3 -m relgen.bench --out $w --seq-lens 512,1024,2048,4096,8192 --mechanisms t5 \
    --systems flex_decomp,flex,compiled --flex-mode max-autotune --process-per group --timeout 40 --min-reps 3 \
    --warmup-ms 10 --rep-ms 50 --budget-s $((535 - SECONDS)) --resume > $o/bench.log 2>&1
echo "bench exit $? after $SECONDS s" >> $o/bench.log
cp $w/attention.json $o/
rm -f $w/*.png
