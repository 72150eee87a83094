# fourteenth session call 3, one H200 with nothing else running: relgen, plain SDPA, eager PyTorch and SDPA with the
# dense bias side by side for t5 and shaw at 256 and 128 (host-bound lengths; calls 1-2 measured them beside a
# CPU-heavy job on the other GPU's cores)
set -u
export PYTHONUNBUFFERED=1
o=/tmp/c3; mkdir -p $o
mv .bench_state/attention.json /tmp/attention.resume.json  # measure afresh
SYSTEMS=relgen,sdpa_plain,eager,sdpa MECHS="t5 shaw" WARM_S=50 \
    bash benchmarks/h200_session.sh bench $o/b ${BUDGET:-170} 256,128 > $o/bench.out 2>&1
tar czf $OUT/c3.tgz -C /tmp c3
tail -3 $o/bench.out
