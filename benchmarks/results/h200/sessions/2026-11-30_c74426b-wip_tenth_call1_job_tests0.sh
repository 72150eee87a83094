# tenth session call 1, GPU 1: the GPU suite's first half on the launch fast path, on the second half of the cores
set -u
o=/tmp/j1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
half=$(( $(nproc) / 2 ))
taskset -c $half-$(( $(nproc) - 1 )) timeout 520 python3 -m pytest -v -n 6 $(cat .bench_state/ids0.txt) -p no:warnings \
    -p no:cacheprovider -rfE > $o/gpu_tests.log 2>&1
echo "tests exit $? at $SECONDS s" >> $o/gpu_tests.log
tar czf $OUT/j1.tgz -C /tmp j1
