# fourteenth session call 1, GPU 1 (cores 16-31): the GPU test suite on the tree
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
o=/tmp/c1g1; mkdir -p $o
VERIFY_S=${VERIFY_S:-550} taskset -c 16-31 bash benchmarks/h200_session.sh verify $o > $o/verify.out 2>&1
tar czf $OUT/c1g1.tgz -C /tmp c1g1
tail -3 $o/gpu_tests.log
