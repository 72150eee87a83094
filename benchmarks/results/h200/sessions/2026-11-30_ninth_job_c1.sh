# call 1, GPU 1: T5's backward at N = 128/256 (the benchmark's problem, per-kernel), then Shaw's tiles tuned alone
set -u
o=/tmp/c1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
timeout 200 python3 .bench_state/t5diag.py > $o/t5diag.jsonl 2> $o/t5diag.err
echo "t5diag exit $? at $SECONDS s" >> $o/t5diag.err
timeout $((555 - SECONDS)) python3 -m relgen tune specs/shaw.yaml --seq-lens 8192 2048 --out $o/shaw.json \
    --budget-s $((540 - SECONDS)) > $o/tune_shaw.log 2>&1
echo "tune exit $? at $SECONDS s" >> $o/tune_shaw.log
tar czf $OUT/c1.tgz -C /tmp c1
