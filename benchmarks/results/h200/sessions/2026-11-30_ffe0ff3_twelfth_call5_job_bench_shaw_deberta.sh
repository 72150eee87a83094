# twelfth session call 5, GPU 0: relgen, plain SDPA, eager PyTorch and SDPA with the dense bias side by side in one
# run, every length, mechanisms shaw deberta_v3, cores 0-15
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS="shaw deberta_v3" WARM_S=90 \
    taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/t0 470 8192,4096,2048,1024,512,256,128 > /tmp/t0.out 2>&1
cp /tmp/t0.out /tmp/t0/
tar czf $OUT/t0.tgz -C /tmp t0
