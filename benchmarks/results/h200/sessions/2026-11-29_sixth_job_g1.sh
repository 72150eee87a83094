# GPU 1: the compiled peers under max-autotune-no-cudagraphs, N >= 512, for what the state lacks
set -u
o=$OUT/g1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
sys=flex_decomp,flex,compiled
w=$(mktemp -d /tmp/g1-XXXX); cp .bench_state/attention.json $w/
for s in deberta_v3 shaw t5; do for n in 512 1024 2048 4096 8192; do
    mkdir -p /tmp/warm_${s}_$n; cp .bench_state/attention.json /tmp/warm_${s}_$n/
    TORCHINDUCTOR_COMPILE_THREADS=2 timeout 220 python3 -m relgen.bench --out /tmp/warm_${s}_$n --mechanisms $s \
        --systems $sys --seq-lens $n --flex-mode max-autotune --process-per group --no-check --min-reps 1 \
        --warmup-ms 1 --rep-ms 1 --timeout 220 --resume > /tmp/warm_${s}_$n.log 2>&1 &
done; done
wait
tail -n 12 /tmp/warm_*.log > $o/warm.log
run() { timeout $(($2 + 30)) python3 -m relgen.bench --out $w --seq-lens $1 --mechanisms shaw,t5,deberta_v3 \
    --systems $sys --flex-mode max-autotune --process-per group --timeout 40 --min-reps 3 --warmup-ms 10 \
    --rep-ms 50 --budget-s $2 --resume >> $o/bench.log 2>&1; }
run 512,1024,2048,4096 200
run 8192 $((520 - SECONDS))
cp $w/attention.json $o/
