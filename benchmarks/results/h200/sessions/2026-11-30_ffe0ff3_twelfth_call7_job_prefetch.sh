# twelfth session call 7 (one H200): interior band tiles' Z̃^Q gathers issued one tile ahead (prefetch) against the tree
set -u
o=/tmp/v0; mkdir -p $o
export PYTHONUNBUFFERED=1
d=/tmp/ab-prefetch; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/prefetch.j2 $d/templates/mechanism.py.j2
ln -s $PWD /tmp/ab-cur
for t in cur prefetch; do for n in 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout 100 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done
PYTHONPATH=/tmp/ab-prefetch:$PYTHONPATH timeout 100 python3 /tmp/ab-prefetch/benchmarks/quick_timing.py --check --specs shaw,deberta_v3 --seq-lens 1024 > $o/check.jsonl 2>$o/check.err &
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in cur prefetch; do
        left=$((170 - SECONDS)); [ $left -lt 15 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw \
            --seq-lens 1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/v0.tgz -C /tmp v0
