# twelfth session call 4 (one H200): diagnostic cost model of an aligned Z̃^Q layout for Shaw's forward:
# alignload = band runs read at 16-byte-aligned addresses (wrong entries), alignskew = that and the prologue's
# stores at a row pitch of ZS - 1 (unaligned, as the layout would need); against the tree
set -u
o=/tmp/s0; mkdir -p $o
export PYTHONUNBUFFERED=1
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
for t in alignload alignskew; do
    d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2
done
ln -s $PWD /tmp/ab-cur
for t in cur alignload alignskew; do for n in 512 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in cur alignload alignskew; do
        left=$((400 - SECONDS)); [ $left -lt 30 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw \
            --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/s0.tgz -C /tmp s0
