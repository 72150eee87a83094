# twelfth session call 3: Shaw's and DeBERTa's forward over forward tiles x the fused prologue's column tile
set -u
o=/tmp/r0; mkdir -p $o
export PYTHONUNBUFFERED=1
echo "sources $(LC_ALL=C; cat templates/*.j2 relgen/*.py | sha256sum | cut -c1-16)" > $o/tree.txt
jobs=""
for sn in "shaw 8192" "shaw 1024" "shaw 512" "deberta_v3 8192"; do
    for i in $(seq 0 14); do
        timeout 240 python3 .bench_state/sweepw.py $sn warm $i >> $o/warm.log 2>&1 &
    done
done
wait
echo "warm done at $SECONDS s" >> $o/warm.log
CUDA_VISIBLE_DEVICES=0 timeout $((560 - SECONDS)) python3 .bench_state/sweepw.py shaw 8192 measure > $o/shaw8k.jsonl 2>$o/shaw8k.err &
CUDA_VISIBLE_DEVICES=1 bash -c "timeout 120 python3 .bench_state/sweepw.py shaw 1024 measure > $o/shaw1k.jsonl 2>$o/shaw1k.err; timeout 100 python3 .bench_state/sweepw.py shaw 512 measure > $o/shaw512.jsonl 2>$o/shaw512.err; timeout 180 python3 .bench_state/sweepw.py deberta_v3 8192 measure > $o/deb8k.jsonl 2>$o/deb8k.err" &
wait
tar czf $OUT/r0.tgz -C /tmp r0
