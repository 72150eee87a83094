# eleventh session call 2, GPU 0: the GPU suite (both halves) on the tree with the forward writing Z^Q, cores 0-21
set -u
o=/tmp/m0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT=$o/gpu_figures.jsonl
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
taskset -c 0-21 timeout 545 python3 -m pytest -v -n 12 $(cat .bench_state/ids0.txt .bench_state/ids1.txt) \
    -p no:warnings -p no:cacheprovider -rfE > $o/gpu_tests.log 2>&1
echo "tests exit $? at $SECONDS s" >> $o/gpu_tests.log
tar czf $OUT/m0.tgz -C /tmp m0
