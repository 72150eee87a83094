# tenth session call 2, GPU 0: half 0 of the GPU suite (the launch fast path, descriptors gated by size)
set -u
o=/tmp/t0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
half=$(( $(nproc) / 2 ))
cores=$(( 0 * half ))-$(( 0 * half + half - 1 ))
git rev-parse HEAD > $o/tree.txt 2>&1; git status --short >> $o/tree.txt 2>&1
taskset -c $cores timeout 540 python3 -m pytest -v -n 7 $(cat .bench_state/ids0.txt) -p no:warnings \
    -p no:cacheprovider -rfE > $o/gpu_tests.log 2>&1
echo "tests exit $? at $SECONDS s" >> $o/gpu_tests.log
tar czf $OUT/t0.tgz -C /tmp t0
