# thirteenth session call 2, GPU 0: band tiles read the clipped column s(δ) (no masks, no end terms: the working
# tree) against the session's start (891aa72's template), alternating rounds in fresh processes, cores 0-15
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
o=/tmp/x0; mkdir -p $o
specs=shaw,deberta_v3,t5,txl
d=/tmp/ab-base; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/base_891aa72.j2 $d/templates/mechanism.py.j2
ln -s $PWD /tmp/ab-clip
for t in base clip; do for n in 512 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
        --specs $specs --seq-lens $n >> $o/warm.jsonl 2>>$o/warm.err &
done; done
PYTHONPATH=/tmp/ab-clip:$PYTHONPATH taskset -c 0-15 timeout 250 python3 /tmp/ab-clip/benchmarks/quick_timing.py --check \
    --specs shaw,deberta_v3,t5,txl,wav2vec2_bert,t5_decoder --seq-lens 1000,2048 > $o/check.jsonl 2>$o/check.err &
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3; do
    for t in base clip; do
        left=$((${BUDGET:-470} - SECONDS)); [ $left -lt 30 ] && break 2
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 0-15 timeout $left python3 /tmp/ab-$t/benchmarks/quick_timing.py \
            --specs $specs --seq-lens 512,1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
done
tar czf $OUT/x0.tgz -C /tmp x0
python3 - <<'PY'
import json, collections
agg = collections.defaultdict(list)
for line in open("/tmp/x0/ab.jsonl"):
    r = json.loads(line)
    agg[(r["spec"], r["seq_len"], r["template"])].append((round(r.get("fwd_ms") or -1, 3), round(r.get("bwd_ms") or -1, 3)))
for k in sorted(agg):
    print(*k, agg[k])
for line in open("/tmp/x0/check.jsonl"):
    r = json.loads(line)
    print("check", r.get("spec"), r.get("seq_len"), r.get("exact"), r.get("error", "")[:200])
PY
