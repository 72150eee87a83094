# tenth session call 3: relgen re-timed at 128-1K alone on the machine (launch fast path, descriptors gated by size)
set -u
o=/tmp/b0; mkdir -p $o
export PYTHONUNBUFFERED=1
git rev-parse HEAD > $o/tree.txt 2>&1; git status --short >> $o/tree.txt 2>&1
mv .bench_state/attention.json /tmp/attention.previous.json
SYSTEMS=relgen WARM_S=75 bash benchmarks/h200_session.sh bench $o 330 128,256,512,1024 > $o/session.log 2>&1
for s in t5 deberta_v3; do for cfg in "" --triton-launch; do
    timeout 60 python3 benchmarks/host_path.py --spec $s --seq-len 512 $cfg >> $o/host.jsonl 2>>$o/host.err
done; done
tar czf $OUT/b0.tgz -C /tmp b0
