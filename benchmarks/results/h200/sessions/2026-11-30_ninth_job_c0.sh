# call 1, GPU 0: the plain-attention ceiling of the forward's design, then three templates at 8K (alternating rounds)
set -u
o=/tmp/c0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > $o/gpu.txt
git rev-parse HEAD > $o/tree.txt 2>&1; git status --short >> $o/tree.txt 2>&1
timeout 150 python3 benchmarks/plain_ceiling.py --seq-len 8192 --json $o/ceiling.jsonl > $o/ceiling.log 2>&1
echo "ceiling exit $? at $SECONDS s" >> $o/ceiling.log
for v in main fat ws; do
    d=/tmp/tree_$v; mkdir -p $d; cp -r relgen benchmarks specs templates $d/
    [ -f .bench_state/$v.j2 ] && cp .bench_state/$v.j2 $d/templates/mechanism.py.j2
done
for round in 1 2; do
    for v in main fat ws; do
        left=$((560 - SECONDS)); [ $left -lt 20 ] && break 2
        extra=""; [ $round = 1 ] && extra="--check"
        PYTHONPATH=/tmp/tree_$v:$PYTHONPATH timeout $left python3 /tmp/tree_$v/benchmarks/quick_timing.py \
            --specs shaw,t5,txl,deberta_v3 --seq-lens 8192 $extra 2>>$o/ab.err \
            | sed "s/^{/{\"template\": \"$v\", \"round\": $round, /" >> $o/ab.jsonl
        echo "$v round $round done at $SECONDS s" >> $o/ab.err
    done
done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv >> $o/gpu.txt
tar czf $OUT/c0.tgz -C /tmp c0
