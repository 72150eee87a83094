# GPU 1: Shaw's (2K-8K) and DeBERTa's (4K, 8K) compiled peers under max-autotune: compile, then measure
set -u
o=$OUT/h1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
w=$(mktemp -d /tmp/h1-XXXX); cp .bench_state/attention.json $w/
PEERS="shaw:2048:flex_decomp shaw:2048:flex shaw:2048:compiled shaw:4096:flex_decomp shaw:4096:flex
shaw:4096:compiled shaw:8192:flex_decomp shaw:8192:compiled deberta_v3:4096:flex_decomp deberta_v3:4096:flex
deberta_v3:4096:compiled deberta_v3:8192:flex_decomp deberta_v3:8192:flex deberta_v3:8192:compiled"
WARM_END=320 source .bench_state/peers.sh
wait
for f in /tmp/warm_shaw_*.log /tmp/warm_deberta_v3_*.log; do echo "== $f"; tail -n 5 $f; done > $o/warm.log
timeout $((548 - SECONDS)) python3 -m relgen.bench --out $w --seq-lens 2048,4096,8192 --mechanisms shaw,deberta_v3 \
    --systems flex_decomp,flex,compiled --flex-mode max-autotune --process-per group --timeout 40 --min-reps 3 \
    --warmup-ms 10 --rep-ms 50 --budget-s $((535 - SECONDS)) --resume > $o/bench.log 2>&1
echo "bench exit $? after $SECONDS s" >> $o/bench.log
cp $w/attention.json $o/
