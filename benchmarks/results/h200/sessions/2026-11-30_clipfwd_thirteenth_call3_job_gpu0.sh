# thirteenth session call 3, GPU 0 (cores 0-15): the forward's edge band tiles read clipped columns (working tree,
# GenerationFlags.clip_band) against the session's start (891aa72's template): exactness, A/B in alternating fresh
# processes, then relgen, plain SDPA, eager PyTorch and SDPA with the dense bias side by side for shaw and t5
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
o=/tmp/y0; mkdir -p $o
specs=shaw,t5,deberta_v3,txl
d=/tmp/ab-base; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/base_891aa72.j2 $d/templates/mechanism.py.j2
ln -s $PWD /tmp/ab-new
for t in base new; do for n in 512 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
        --specs $specs --seq-lens $n >> $o/warm.jsonl 2>>$o/warm.err &
done; done
PYTHONPATH=/tmp/ab-new:$PYTHONPATH taskset -c 0-15 timeout 250 python3 /tmp/ab-new/benchmarks/quick_timing.py --check \
    --specs shaw,deberta_v3,t5,txl,wav2vec2_bert,t5_decoder --seq-lens 1000,2048 > $o/check.jsonl 2>$o/check.err &
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in base new; do
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout 100 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
            --specs $specs --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
mv .bench_state/attention.json /tmp/attention.resume.json  # measure everything afresh
left=$((${BUDGET:-540} - SECONDS - 20))
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS="shaw t5" WARM_S=60 \
    taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/y0b $left 8192,4096,2048,1024,512,256,128 > /tmp/y0b.out 2>&1
cp /tmp/y0b.out /tmp/y0b/ 2>/dev/null; cp -r /tmp/y0b $o/
tar czf $OUT/y0.tgz -C /tmp y0
python3 - <<'PY'
import json, collections
agg = collections.defaultdict(list)
for line in open("/tmp/y0/ab.jsonl"):
    r = json.loads(line)
    agg[(r["spec"], r["seq_len"], r["template"])].append((round(r.get("fwd_ms") or -1, 3), round(r.get("bwd_ms") or -1, 3)))
for k in sorted(agg):
    print(*k, agg[k])
for line in open("/tmp/y0/check.jsonl"):
    r = json.loads(line)
    print("check", r.get("spec"), r.get("seq_len"), r.get("exact"), r.get("error", "")[:200])
PY
tail -3 /tmp/y0b.out
