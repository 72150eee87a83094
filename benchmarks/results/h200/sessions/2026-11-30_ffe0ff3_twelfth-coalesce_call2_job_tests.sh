# twelfth session call 2, GPU 1: the GPU suite on the tree (band gathers of interior tiles as [R, 1, C]), cores 16-31
set -u
o=/tmp/q1; mkdir -p $o
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT=$o/gpu_figures.jsonl
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
taskset -c 16-31 timeout 550 python3 -m pytest -v -n 12 $(cat .bench_state/ids0.txt .bench_state/ids1.txt) \
    -p no:warnings -p no:cacheprovider -rfE > $o/gpu_tests.log 2>&1
echo "tests exit $? at $SECONDS s" >> $o/gpu_tests.log
tar czf $OUT/q1.tgz -C /tmp q1
