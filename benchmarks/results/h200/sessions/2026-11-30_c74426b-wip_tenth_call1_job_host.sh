# tenth session call 1, GPU 0: the host path at 512 / 1K (relgen's launch vs Triton's, descriptors on / off),
# each configuration in fresh processes (benchmarks/host_path.py), pinned to the first half of the cores
set -u
o=/tmp/j0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
half=$(( $(nproc) / 2 ))
pin="taskset -c 0-$((half - 1))"
{ nproc; lscpu | grep -E "Model name|Socket|NUMA|MHz"; nvidia-smi topo -m; cat /proc/loadavg; } > $o/sys.txt 2>&1
git rev-parse HEAD > $o/tree.txt 2>&1; git status --short >> $o/tree.txt 2>&1
for s in shaw txl deberta_v3 t5; do for n in 512 1024; do for d in "" --no-descriptors; do
    $pin timeout 240 python3 benchmarks/host_path.py --spec $s --seq-len $n $d >> $o/warm.jsonl 2>>$o/warm.err &
done; done; done
wait
echo "warm done at $SECONDS s" >> $o/warm.err
for rep in 1 2; do
    for s in t5 deberta_v3 shaw txl; do for n in 512 1024; do
        for cfg in "" "--triton-launch" "--no-descriptors"; do
            left=$((540 - SECONDS)); [ $left -lt 15 ] && break 4
            extra=""; [ $rep = 1 ] && [ "$n" = 512 ] && [ -z "$cfg" ] && extra="--profile"
            $pin timeout $left python3 benchmarks/host_path.py --spec $s --seq-len $n $cfg $extra >> $o/host.jsonl 2>>$o/host.err
        done
    done; done
    echo "rep $rep done at $SECONDS s" >> $o/host.err
done
cat /proc/loadavg >> $o/sys.txt
tar czf $OUT/j0.tgz -C /tmp j0
