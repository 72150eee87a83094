# fourteenth session call 2, GPU 0 (cores 0-15): relgen, plain SDPA, eager PyTorch and SDPA with the dense bias side
# by side for shaw at 512, 256, 128 on the tree
set -u
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
o=/tmp/c2g0; mkdir -p $o
mv .bench_state/attention.json /tmp/attention.resume.json  # measure afresh
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS=shaw WARM_S=60 \
    taskset -c 0-15 bash benchmarks/h200_session.sh bench $o/b ${BUDGET:-300} 512,256,128 > $o/bench.out 2>&1
tar czf $OUT/c2g0.tgz -C /tmp c2g0
tail -3 $o/bench.out
