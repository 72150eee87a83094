# thirteenth session call 4, GPU 1 (cores 16-31): relgen (final tree), plain SDPA, eager PyTorch and SDPA with the
# dense bias side by side at every length for shaw and t5 (the mechanisms whose kernels changed); then the final
# tree against 891aa72's template, alternating fresh processes (compiled during the bench's compile-only phase)
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
o=/tmp/z1ab; mkdir -p $o
d=/tmp/ab-base; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/base_891aa72.j2 $d/templates/mechanism.py.j2
ln -s $PWD /tmp/ab-final
for t in base final; do for n in 512,1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 16-31 timeout 70 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
        --specs shaw,t5 --seq-lens $n >> $o/warm.jsonl 2>>$o/warm.err &
done; done
mv .bench_state/attention.json /tmp/attention.resume.json  # measure everything afresh
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS="shaw t5" WARM_S=75 \
    taskset -c 16-31 bash benchmarks/h200_session.sh bench /tmp/z1 ${BENCH_S:-200} 8192,4096,2048,1024,512,256,128 > /tmp/z1.out 2>&1
wait
cp /tmp/z1.out /tmp/z1/
echo "bench done at $SECONDS s" >> $o/ab.err
for round in 1 2; do
    for t in base final; do
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 16-31 timeout 50 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
            --specs shaw,t5 --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
cp -r /tmp/z1 $o/bench
tar czf $OUT/z1.tgz -C /tmp z1ab
tail -3 /tmp/z1.out
python3 - <<'PY'
import json, collections
agg = collections.defaultdict(list)
for line in open("/tmp/z1ab/ab.jsonl"):
    r = json.loads(line)
    agg[(r["spec"], r["seq_len"], r["template"])].append((round(r.get("fwd_ms") or -1, 3), round(r.get("bwd_ms") or -1, 3)))
for k in sorted(agg):
    print(*k, agg[k])
PY
