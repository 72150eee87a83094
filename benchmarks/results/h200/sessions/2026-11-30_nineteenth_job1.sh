#!/bin/bash
# job1.sh OUT: Shaw at 512/1K/2K/8K, rounds over head, head32 (block_w 32), merge32, ilv32
out=$1; V=$PWD/.bench_state/var3
for r in 1 2; do
  for v in head head32 merge32 ilv32; do
    PYTHONPATH=$V/$v:$PYTHONPATH timeout 150 python3 $V/$v/benchmarks/quick_timing.py --specs shaw --seq-lens 512,1024,2048,8192 \
      2>>$out/job1.err | sed "s/^/$v $r /" >> $out/job1.log
  done
done
