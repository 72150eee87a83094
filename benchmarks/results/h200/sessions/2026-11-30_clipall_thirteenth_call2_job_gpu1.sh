# thirteenth session call 2, GPU 1: the GPU test suite on the working tree, cores 16-31
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
o=/tmp/x1; mkdir -p $o
VERIFY_S=${VERIFY_S:-480} taskset -c 16-31 bash benchmarks/h200_session.sh verify $o > $o/verify.out 2>&1
tar czf $OUT/x1.tgz -C /tmp x1
tail -5 $o/gpu_tests.log
