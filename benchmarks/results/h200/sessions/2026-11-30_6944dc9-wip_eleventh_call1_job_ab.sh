# eleventh session call 1, GPU 0: the forward writing its own rows of Z^Q (the tree) against main's template and the
# band-first variant; correctness of the tree first. Pinned to the first half of the cores.
set -u
o=/tmp/k0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
half=$(( $(nproc) / 2 ))
pin="taskset -c 0-$((half - 1))"
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
for t in main bandfirst; do
    d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2
done
# compile everything in parallel first (timings discarded)
for root in $PWD /tmp/ab-main /tmp/ab-bandfirst; do for s in shaw deberta_v3; do for n in 512 1024 8192; do
    PYTHONPATH=$root:$PYTHONPATH $pin timeout 200 python3 $root/benchmarks/quick_timing.py --specs $s --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done; done
$pin timeout 230 python3 benchmarks/quick_timing.py --check --specs shaw,deberta_v3,wav2vec2_bert --seq-lens 1024,2048 \
    > $o/check.jsonl 2>$o/check.err &
wait
echo "warm+check done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for root in /tmp/ab-main $PWD /tmp/ab-bandfirst; do
        left=$((545 - SECONDS)); [ $left -lt 40 ] && break 2
        PYTHONPATH=$root:$PYTHONPATH $pin timeout $left python3 $root/benchmarks/quick_timing.py --specs shaw,deberta_v3 \
            --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$(basename $root)\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/k0.tgz -C /tmp k0
