# GPU 1: A/B of the forward with saturated tiles folded into the running max (.bench_state/fold.j2) against the
# current template, then Shaw's tiles tuned alone (table to $OUT, the repo's table untouched)
set -u
o=/tmp/d1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
timeout 170 bash benchmarks/ab_templates.sh .bench_state/fold.j2 $o/ab.jsonl 2 shaw,t5 1024,8192 > $o/ab.log 2>&1
echo "ab exit $? after $SECONDS s" >> $o/ab.log
timeout 120 python3 -m relgen tune specs/shaw.yaml --seq-lens 8192 2048 --budget-s 90 --out $o/shaw_alone.json \
    > $o/tune_shaw.log 2>&1
echo "tune exit $? after $SECONDS s" >> $o/tune_shaw.log
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >> $o/gpu.txt
tar czf $OUT/d1.tgz -C /tmp d1
