# twelfth session call 5, GPU 1: relgen, plain SDPA, eager PyTorch and SDPA with the dense bias side by side in one
# run, every length, mechanisms t5 txl, cores 16-31
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS="t5 txl" WARM_S=90 \
    taskset -c 16-31 bash benchmarks/h200_session.sh bench /tmp/t1 470 8192,4096,2048,1024,512,256,128 > /tmp/t1.out 2>&1
cp /tmp/t1.out /tmp/t1/
tar czf $OUT/t1.tgz -C /tmp t1
