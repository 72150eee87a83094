# tenth session call 4: Shaw's 8K forward tiles (4 stages); relgen's closest N >= 512 forwards in fresh processes
set -u
o=/tmp/b1; mkdir -p $o
export PYTHONUNBUFFERED=1
git rev-parse HEAD > $o/tree.txt 2>&1; git status --short >> $o/tree.txt 2>&1
timeout 150 python3 .bench_state/sweep8k.py > $o/sweep8k.jsonl 2> $o/sweep8k.err
echo "sweep done at $SECONDS s" >> $o/runs.log
for rep in 1 2 3 4; do
    for mn in t5:512 deberta_v3:512 shaw:1024; do
        left=$((400 - SECONDS)); [ $left -lt 20 ] && break 2
        m=${mn%:*}; n=${mn#*:}
        timeout $left python3 -m relgen.bench --systems relgen --mechanisms $m --seq-lens $n --passes fwd \
            --process-per measurement --min-reps 3 --warmup-ms 10 --rep-ms 50 --out $o/rep${rep}_$m >> $o/runs.log 2>&1
    done
done
echo "repeats done at $SECONDS s" >> $o/runs.log
tar czf $OUT/b1.tgz -C /tmp b1
