# GPU 1: compile pass (relgen's kernels at every bucket; T5's FlexAttention + decomposition at 512 and 1K under
# max-autotune), then T5 at 512 and 1K: relgen, plain SDPA and that peer side by side; then relgen at every length
set -u
o=$OUT/f1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
w=$(mktemp -d /tmp/f1-XXXX); cp .bench_state/attention.json $w/
for s in shaw txl deberta_v3 t5; do
    timeout 170 python3 -m relgen warmup specs/$s.yaml --seq-lens 128 256 512 1024 2048 4096 8192 > /tmp/wu_$s.log 2>&1 &
done
for n in 512 1024; do
    mkdir -p /tmp/warm_t5_$n; cp .bench_state/attention.json /tmp/warm_t5_$n/
    TORCHINDUCTOR_COMPILE_THREADS=8 timeout 170 python3 -m relgen.bench --out /tmp/warm_t5_$n --mechanisms t5 \
        --systems flex_decomp --seq-lens $n --flex-mode max-autotune --process-per group --no-check \
        --min-reps 1 --warmup-ms 1 --rep-ms 1 --timeout 170 --resume > /tmp/warm_t5_$n.log 2>&1 &
done
wait
tail -n 8 /tmp/warm_t5_*.log /tmp/wu_*.log > $o/warm.log
run() { timeout $(($4 + 30)) python3 -m relgen.bench --out $w --seq-lens $1 --mechanisms $2 --systems $3 \
    --flex-mode max-autotune --process-per group --timeout 60 --min-reps 3 --warmup-ms 10 --rep-ms 50 \
    --budget-s $4 --resume >> $o/bench.log 2>&1; }
run 512,1024 t5 relgen,sdpa_plain,flex_decomp 90
run 8192,4096,2048,1024,512,256,128 shaw,txl,deberta_v3,t5 relgen $((530 - SECONDS))
cp $w/attention.json $o/
