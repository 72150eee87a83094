# eleventh session call 1, GPU 1: the two compiled-peer backwards at 8K that timed out (DeBERTa FlexAttention on the
# dense bias, Shaw torch.compile), max-autotune compiles given 470 s, on the second half of the cores
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
half=$(( $(nproc) / 2 ))
SYSTEMS=flex,compiled WARM_S=470 WARM_THREADS=8 MEASURE_TIMEOUT_S=80 MECHS="deberta_v3 shaw" \
    taskset -c $half-$(( $(nproc) - 1 )) bash benchmarks/h200_session.sh bench /tmp/k1 565 8192 > /tmp/k1.out 2>&1
cp /tmp/k1.out /tmp/k1/; cp /tmp/warm_bench_*.log /tmp/k1/ 2>/dev/null
tar czf $OUT/k1.tgz -C /tmp k1
