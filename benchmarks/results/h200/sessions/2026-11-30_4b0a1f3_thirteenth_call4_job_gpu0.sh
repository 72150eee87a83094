# thirteenth session call 4, GPU 0 (cores 0-15): the final tree (the forward's edge band tiles clamp their
# columns, _clamped_run; every other kernel compiles as at 891aa72): exactness against the FP64 reference, then the
# GPU tests that exercise the forward's band tiles (half precision, long, packed, offsets, key padding, fp32, maps)
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
o=/tmp/z0; mkdir -p $o
taskset -c 0-15 timeout 150 python3 benchmarks/quick_timing.py --check \
    --specs shaw,t5,wav2vec2_bert,t5_decoder,deberta_v3,txl --seq-lens 1000,2048 > $o/check.jsonl 2>$o/check.err
echo "check done at $SECONDS s" >> $o/check.err
RELGEN_GPU_REPORT=$o/gpu_figures.jsonl taskset -c 0-15 timeout $((${BUDGET:-330} - SECONDS)) python3 -m pytest -v -n 8 \
    tests/test_gpu.py tests/test_features.py -p no:warnings -p no:cacheprovider -rfE \
    -k "half_precision or features_long or packed or position_offsets or key_padding or fp32_is_exact or every_map_kind or deterministic or recompute" \
    > $o/gpu_tests.log 2>&1
echo "tests exit $? at $SECONDS s" >> $o/gpu_tests.log
tar czf $OUT/z0.tgz -C /tmp z0
for line in $(cat $o/check.jsonl | python3 -c "import json,sys; [print(f\"{r['spec']}@{r['seq_len']}={r.get('exact')}\") for r in map(json.loads, sys.stdin)]"); do echo check $line; done
grep -o "PASSED\|FAILED\|ERROR" $o/gpu_tests.log | sort | uniq -c; tail -2 $o/gpu_tests.log
