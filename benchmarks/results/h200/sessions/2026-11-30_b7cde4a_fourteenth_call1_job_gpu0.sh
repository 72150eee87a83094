# fourteenth session call 1, GPU 0 (cores 0-15): A/B of the forward's loop order (e1a: co-resident programs out of
# phase, half band-first / half band-last by (program // 132) % 2; e1c: every program band-last) against the tree
# (band-first), alternating fresh processes; then relgen, plain SDPA, eager PyTorch and SDPA with the dense bias
# side by side for t5 at every length on the tree
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
o=/tmp/c1g0; mkdir -p $o
specs=shaw,t5,deberta_v3
for t in e1a e1c; do d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2; done
ln -s $PWD /tmp/ab-cur
for t in cur e1a e1c; do for n in 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout 150 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
        --specs $specs --seq-lens $n >> $o/warm.jsonl 2>>$o/warm.err &
done; done
PYTHONPATH=/tmp/ab-e1a:$PYTHONPATH taskset -c 0-15 timeout 150 python3 /tmp/ab-e1a/benchmarks/quick_timing.py --check \
    --specs shaw,t5,deberta_v3 --seq-lens 1000 > $o/check.jsonl 2>$o/check.err &
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in cur e1a e1c; do
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout 60 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
            --specs $specs --seq-lens 1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
mv .bench_state/attention.json /tmp/attention.resume.json  # measure afresh
left=$((${BUDGET:-560} - SECONDS - 25))
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS=t5 WARM_S=75 \
    taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/c1g0b $left 8192,4096,2048,1024,512,256,128 > /tmp/c1g0b.out 2>&1
cp /tmp/c1g0b.out /tmp/c1g0b/ 2>/dev/null; cp -r /tmp/c1g0b $o/
tar czf $OUT/c1g0.tgz -C /tmp c1g0
python3 - <<'PY'
import json, collections
agg = collections.defaultdict(list)
for line in open("/tmp/c1g0/ab.jsonl"):
    r = json.loads(line)
    agg[(r["spec"], r["seq_len"], r["template"])].append((round(r.get("fwd_ms") or -1, 3), round(r.get("bwd_ms") or -1, 3)))
for k in sorted(agg):
    print(*k, agg[k])
for line in open("/tmp/c1g0/check.jsonl"):
    r = json.loads(line)
    print("check", r.get("spec"), r.get("seq_len"), r.get("exact"), r.get("error", "")[:200])
PY
tail -3 /tmp/c1g0b.out
