# call 3 on GPU $1: GPU 0 the decode diagnosis (main's template vs this tree) and the tests left from call 2, then
# relgen re-timed at $2; GPU 1 relgen re-timed at $2 at once
set -u
g=$1; lengths=$2; o=/tmp/w$g; mkdir -p $o; root=$PWD
export CUDA_VISIBLE_DEVICES=$g PYTHONUNBUFFERED=1
echo "sources sha256: $(LC_ALL=C; cat templates/*.j2 relgen/*.py relgen/bench/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
if [ "$g" = 0 ]; then
    d=/tmp/tree_main; mkdir -p $d; cp -r relgen specs templates $d/; cp .bench_state/main.j2 $d/templates/mechanism.py.j2
    (cd $d && PYTHONPATH=$d:$PYTHONPATH timeout 100 python3 $root/.bench_state/decode_diag.py main) > $o/decode.jsonl 2> $o/decode.err
    timeout 100 python3 .bench_state/decode_diag.py this >> $o/decode.jsonl 2>> $o/decode.err
    RELGEN_GPU_REPORT=$o/gpu_figures.jsonl timeout 240 python3 -m pytest -v -n 8 -p no:warnings -p no:cacheprovider \
        -rfE --tb=short tests/test_gpu.py::test_features_long tests/test_gpu.py::test_packed_long \
        "tests/test_features.py::test_packed_sequences[0.25-sym]" \
        tests/test_kernels.py::test_descriptors_only_for_layouts_tma_reads > $o/gpu_tests.log 2>&1
    echo "tests exit $? after $SECONDS s" >> $o/gpu_tests.log
fi
left=$((550 - SECONDS))
SYSTEMS=relgen,sdpa_plain bash benchmarks/h200_session.sh bench $o/bench $left $lengths > $o/session.out 2>&1
tar czf $OUT/w$g.tgz -C /tmp w$g
