# GPU 0: the GPU test suite on the final kernels, then Table 7's ablations at 8K with the time left
set -u
o=$OUT/f0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT=$o/gpu_figures.jsonl
timeout 320 python3 -m pytest -q -n 10 tests/test_gpu.py tests/test_features.py -p no:warnings -p no:cacheprovider \
    -rfE > $o/gpu_tests.log 2>&1
echo "tests exit $? after $SECONDS s" >> $o/gpu_tests.log
left=$((528 - SECONDS))
timeout $((left + 20)) python3 -m relgen.bench --ablation --out $o --seq-lens 8192 --mechanisms deberta_v3,t5,shaw,txl \
    --process-per group --timeout 60 --min-reps 3 --warmup-ms 10 --rep-ms 50 --budget-s $left > $o/ablation.log 2>&1
echo "ablation exit $?" >> $o/ablation.log
rm -f $o/*.png
