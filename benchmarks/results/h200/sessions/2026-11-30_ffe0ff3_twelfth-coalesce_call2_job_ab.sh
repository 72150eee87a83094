# twelfth session call 2, GPU 0: band gathers loaded as [R, 1, C] (a warp's scalar loads along one run): the tree
# (interior tiles only) and full3d (edge tiles too) against the session's start (ffe0ff3); exactness of the tree. Cores 0-15.
set -u
o=/tmp/q0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
pin="taskset -c 0-15"
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
for t in start full3d; do
    d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2
done
ln -s $PWD /tmp/ab-cur
for t in cur start full3d; do for s in shaw deberta_v3; do for n in 512 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs $s --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done; done
$pin timeout 240 python3 benchmarks/quick_timing.py --check --specs shaw,deberta_v3,wav2vec2_bert,txl,t5 --seq-lens 1024 \
    > $o/check.jsonl 2>$o/check.err &
wait
echo "warm+check done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in start cur full3d; do
        left=$((555 - SECONDS)); [ $left -lt 30 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH $pin timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw,deberta_v3 \
            --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/q0.tgz -C /tmp q0
