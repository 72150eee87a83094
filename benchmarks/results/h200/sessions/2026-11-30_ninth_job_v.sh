# call 2: one half of the GPU suite (ids$1.txt) on GPU $1, then Shaw's tiles tuned alone at the lengths $2
set -u
g=$1; o=/tmp/v$g; mkdir -p $o
export CUDA_VISIBLE_DEVICES=$g PYTHONUNBUFFERED=1
git log --oneline -1 > $o/tree.txt 2>&1
echo "sources sha256: $(LC_ALL=C; cat templates/*.j2 relgen/*.py relgen/bench/*.py | sha256sum | cut -c1-16)" >> $o/tree.txt
RELGEN_GPU_REPORT=$o/gpu_figures.jsonl timeout 345 python3 -m pytest -v -n 8 -p no:warnings -p no:cacheprovider -rfE \
    --tb=short $(cat .bench_state/ids$g.txt) > $o/gpu_tests.log 2>&1
echo "tests exit $? after $SECONDS s" >> $o/gpu_tests.log
left=$((545 - SECONDS))
[ $left -gt 60 ] && timeout $left python3 -m relgen tune specs/shaw.yaml --seq-lens $2 --out $o/shaw.json \
    --budget-s $((left - 15)) > $o/tune_shaw.log 2>&1
echo "tune exit $? after $SECONDS s" >> $o/tune_shaw.log
tar czf $OUT/v$g.tgz -C /tmp v$g
