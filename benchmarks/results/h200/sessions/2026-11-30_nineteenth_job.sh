#!/bin/bash
# job.sh ROLE OUT [variants]: ROLE=time (A/B rounds, Shaw 8K); check (exactness with descriptors forced, then rounds
# of Shaw at 1K/2K/4K and wav2vec2_bert at 8K)
role=$1; out=$2; shift 2; V=$PWD/.bench_state/var3
variants=${*:-"head merge ilv ilvtop ilv32"}
qt() { v=$1; shift; PYTHONPATH=$V/$v:$PYTHONPATH timeout 150 python3 $V/$v/benchmarks/quick_timing.py "$@"; }
if [ "$role" = time ]; then
  for r in 1 2 3; do
    for v in $variants; do
      qt $v --specs shaw --seq-lens 8192 2>>$out/time.err | sed "s/^/$v $r /" >> $out/time.log
    done
  done
elif [ "$role" = check ]; then
  for v in $variants; do
    [ $v = head ] && continue; [ $v = merge ] && continue
    qt $v --check --descriptors --specs shaw,wav2vec2_bert --seq-lens 300,1000,2048 2>>$out/check.err \
      | sed "s/^/$v /" >> $out/check.log
  done
  for r in 1 2; do
    for v in ${ROUNDS:-head ilv ilv32}; do
      qt $v --specs shaw --seq-lens 512,1024,2048,4096 2>>$out/time1.err | sed "s/^/$v $r /" >> $out/time1.log
      qt $v --specs wav2vec2_bert --seq-lens 8192 2>>$out/time1.err | sed "s/^/$v $r /" >> $out/time1.log
    done
  done
fi
