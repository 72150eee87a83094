# twelfth session call 1, GPU 0: where Shaw's forward spends its time beyond the plain kernel (diagnostic templates:
# no Z^Q stores, no band gathers, no prologue) and the band-add-after-dot candidate, against the tree; then
# a19c138's template ("main") against the tree at N = 128 / 256. Cores 0-15.
set -u
o=/tmp/p0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
pin="taskset -c 0-15"
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
for t in afterdot nowrite nogather noprologue main; do
    d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2
done
ln -s $PWD /tmp/ab-cur
for t in cur afterdot nowrite nogather noprologue; do for n in 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done
for t in cur main; do for s in shaw deberta_v3; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs $s --seq-lens 128,256 \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in cur afterdot nowrite nogather noprologue; do
        left=$((560 - SECONDS)); [ $left -lt 30 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw \
            --seq-lens 1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    for t in main cur; do
        left=$((560 - SECONDS)); [ $left -lt 30 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw,deberta_v3 \
            --seq-lens 128,256 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/small.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/p0.tgz -C /tmp p0
