# eleventh session call 2, GPU 1: the ablations (Table 7) at 8K on the current kernels, cores 22-31
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
taskset -c 22-31 bash benchmarks/h200_session.sh ablation /tmp/m1 500 > /tmp/m1.out 2>&1
cp /tmp/m1.out /tmp/m1/
tar czf $OUT/m1.tgz -C /tmp m1
