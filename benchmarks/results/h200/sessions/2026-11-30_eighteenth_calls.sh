#!/bin/bash
# Eighteenth session's device calls as they ran (three calls on one nvidia-h200-x2, 828 s of device time).
# Each started: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD;
# Variant trees lived in .bench_state/var*/ (carried): copies of relgen/ templates/ specs/ benchmarks/*.py, each with
# one template (the diffs beside this file); `head` = git archive of 6fa9561 (the session's start).
#   diag       = …_diag_tma.diff (Z̃^Q's diagonal layout, every forward band tile through a TMA box)
#   inner      = diag with only INNER tiles through the box (…_diag_inner_only.diff)
#   merge      = head + …_template_merge.diff (the saturated runs [0, hi) and [lo, valid) in one loop)
#   mergeinner = inner + the same edit
#   m2, m3     = merge + the two edge band runs in one loop (m2) / every band tile in one BAND loop (m3): …_over_merge.diff
#   m3s4       = m3 with Shaw's 8K forward entry at num_stages 4
# job.sh ROLE OUT (calls 1 and 2): ROLE=time: 3 rounds of
#   PYTHONPATH=$V/$v:$PYTHONPATH python3 $V/$v/benchmarks/quick_timing.py --specs shaw --seq-lens 8192
# over the variants in turn (fresh process each); ROLE=check: quick_timing.py --check --descriptors (exactness with the
# descriptor paths forced) on the new variants, then 2 more rounds (call 2: --specs shaw,t5).
# Call 1: variants "head diag inner merge mergeinner"; check diag/inner/mergeinner at shaw 1000,2048, merge at shaw,t5 1000
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash .bench_state/var/job.sh time $OUT &
CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var/job.sh check $OUT; wait
# Call 2: variants "head merge m2 m3 m3s4"; check m2, m3 at shaw,t5 1000,2048
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash .bench_state/var/job.sh time $OUT &
CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var/job.sh check $OUT; wait
# Call 3: the seventeenth session's prepared A/B of the fully flat table reduction (its calls script, "next"):
# cur = 6fa9561, flat = + …seventeenth_reduce_fullflat.diff, flat3 = flat + every reduce entry at 3 stages
# (.bench_state/sm90_reduce_s3.json); job.sh OUT ROUNDS runs, per round,
#   PYTHONPATH=$V/$t:$PYTHONPATH python3 $V/$t/benchmarks/profile_kernels.py --specs shaw,deberta_v3,t5,txl \
#       --seq-lens 128,512,2048,8192
# and check.sh runs quick_timing.py --check --seq-lens 128,1000 --specs shaw,txl,deberta_v3,t5,t5_decoder,wav2vec2_bert
# on flat and flat3.
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash .bench_state/var2/job.sh $OUT cur flat flat3 &
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var2/check.sh $OUT
 CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var2/job.sh $OUT flat3 cur); wait
