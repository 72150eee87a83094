# thirteenth session call 1 (one H200): band tiles' Z̃^Q read as aligned runs through an identity product (the
# pipeliner then prefetches them with cp.async), priced by diagnostic templates (wrong entries, real access patterns)
set -u
o=/tmp/w0; mkdir -p $o
export PYTHONUNBUFFERED=1
vars="d1 d2 d2s3 d2skew"
ln -s $PWD /tmp/ab-cur
for t in $vars; do
    d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/idot_$t.j2 $d/templates/mechanism.py.j2
done
for t in cur $vars; do for n in 512,1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout 150 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw --seq-lens $n \
        >> $o/warm.jsonl 2>>$o/warm.err &
done; done
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in cur $vars; do
        left=$((${BUDGET:-420} - SECONDS)); [ $left -lt 20 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs shaw \
            --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
cp $o/ab.jsonl $OUT/ 2>/dev/null; tar czf $OUT/w0.tgz -C /tmp w0
python3 - <<'PY'
import json, collections
rows = [json.loads(l) for l in open("/tmp/w0/ab.jsonl")]
agg = collections.defaultdict(list)
for r in rows:
    agg[(r["template"], r.get("seq_len") or r.get("n"))].append((r.get("fwd_ms"), r.get("bwd_ms")))
for k in sorted(agg, key=str):
    print(k, agg[k])
PY
