# One half of the GPU suite (ids$1.txt) on GPU $1, then: GPU 0 TXL's missing ablation (no_projections, 8K),
# GPU 1 relgen and plain SDPA at 512 and 8K on this tree (a check against the committed figures)
set -u
g=$1; o=$OUT/v$g; mkdir -p $o
export CUDA_VISIBLE_DEVICES=$g PYTHONUNBUFFERED=1
RELGEN_GPU_REPORT=$o/gpu_figures.jsonl timeout 330 python3 -m pytest -v -n 8 -p no:warnings -p no:cacheprovider -rfE \
    --tb=short $(cat .bench_state/ids$g.txt) > $o/gpu_tests.log 2>&1
echo "tests exit $? after $SECONDS s" >> $o/gpu_tests.log
if [ "$g" = 0 ]; then
    cp benchmarks/results/h200/ablation.json $o/
    timeout $((465 - SECONDS)) python3 -m relgen.bench --ablation --out $o --seq-lens 8192 --mechanisms txl \
        --process-per group --timeout 60 --min-reps 3 --warmup-ms 10 --rep-ms 50 --budget-s $((450 - SECONDS)) \
        --resume > $o/ablation.log 2>&1
    echo "ablation exit $? after $SECONDS s" >> $o/ablation.log
else
    timeout $((465 - SECONDS)) python3 -m relgen.bench --out $o --seq-lens 512,8192 --systems relgen,sdpa_plain \
        --process-per group --timeout 60 --min-reps 3 --warmup-ms 10 --rep-ms 50 --budget-s $((450 - SECONDS)) \
        > $o/bench.log 2>&1
    echo "bench exit $? after $SECONDS s" >> $o/bench.log
fi
rm -f $o/*.png $o/*.md
