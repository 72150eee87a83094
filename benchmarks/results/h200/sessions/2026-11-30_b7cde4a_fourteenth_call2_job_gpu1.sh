# fourteenth session call 2, GPU 1 (cores 16-31): A/B of two forward variants against the tree, alternating fresh
# processes: p1 = the prologue's product for the next column tile issued before the current tile's stores;
# ev = the band tiles' gathers of Z̃^Q loaded with eviction_policy="evict_first" (their last use)
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
o=/tmp/c2g1; mkdir -p $o
specs=shaw,t5
for t in p1 ev; do d=/tmp/ab-$t; mkdir -p $d; cp -r relgen benchmarks specs templates $d/; cp .bench_state/$t.j2 $d/templates/mechanism.py.j2; done
ln -s $PWD /tmp/ab-cur
for t in cur p1 ev; do for n in 1024 8192; do
    PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 16-31 timeout 150 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
        --specs $specs --seq-lens $n >> $o/warm.jsonl 2>>$o/warm.err &
done; done
for t in p1 ev; do
PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 16-31 timeout 200 python3 /tmp/ab-$t/benchmarks/quick_timing.py --check \
    --specs shaw,t5,deberta_v3 --seq-lens 1000 > $o/check_$t.jsonl 2>$o/check_$t.err &
done
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for round in 1 2 3 4; do
    for t in cur p1 ev; do
        PYTHONPATH=/tmp/ab-$t:$PYTHONPATH taskset -c 16-31 timeout 60 python3 /tmp/ab-$t/benchmarks/quick_timing.py \
            --specs $specs --seq-lens 1024,8192 2>>$o/ab.err | sed "s/^{/{\"template\": \"$t\", \"round\": $round, /" >> $o/ab.jsonl
    done
    echo "round $round done at $SECONDS s" >> $o/ab.err
    [ $SECONDS -gt 430 ] && break
done
tar czf $OUT/c2g1.tgz -C /tmp c2g1
python3 - <<'PY'
import json, collections, glob
agg = collections.defaultdict(list)
for line in open("/tmp/c2g1/ab.jsonl"):
    r = json.loads(line)
    agg[(r["spec"], r["seq_len"], r["template"])].append((round(r.get("fwd_ms") or -1, 3), round(r.get("bwd_ms") or -1, 3)))
for k in sorted(agg):
    print(*k, agg[k])
for f in sorted(glob.glob("/tmp/c2g1/check_*.jsonl")):
    for line in open(f):
        r = json.loads(line)
        print("check", f[-8:], r.get("spec"), r.get("seq_len"), r.get("exact"), r.get("error", "")[:200])
PY
