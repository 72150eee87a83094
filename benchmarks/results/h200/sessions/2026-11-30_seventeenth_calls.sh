# Seventeenth session's device calls (one nvidia-h200-x2 held across calls 1 and 2: call 2 is issued within the
# machine's 30 s idle release of call 1, so call 1's compile caches in /tmp carry over).
#   bash benchmarks/results/h200/sessions/2026-11-30_seventeenth_calls.sh call1|call2
# every call starts with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# carry: .whl .bench_state
set -u
case ${1:?call1 or call2} in
call1)  # GPU 0: the GPU suite on the current tree (the call-signature cache's first GPU run); GPU 1: T5's forward
    # host path at 512 three times, then compile every system for the four mechanisms at 128, 256, 512
    (CUDA_VISIBLE_DEVICES=0 VERIFY_S=530 taskset -c 0-15 bash benchmarks/h200_session.sh verify /tmp/v \
        > /tmp/v.out 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1; taskset -pc 16-31 $BASHPID > /dev/null
     mkdir -p /tmp/hp
     for r in 1 2 3; do
         timeout 60 python3 benchmarks/host_path.py --spec t5 --seq-len 512 >> /tmp/hp/host_path.jsonl 2>>/tmp/hp/err
     done
     COMPILE_JOBS=10 MECHS="t5 txl shaw deberta_v3" bash benchmarks/h200_session.sh compile /tmp/c 400 \
         512,256,128 > /tmp/c.out 2>&1) &
    wait
    tail -3 /tmp/v/gpu_tests.log; cat /tmp/hp/host_path.jsonl; cat /tmp/c/compile.log | tail -40
    tar czf "$OUT/call1.tgz" -C /tmp v v.out hp c c.out $(cd /tmp && ls -d compile_*.log)
    ;;
call2)  # every system at 128, 256, 512 side by side, nothing resumed: T5 and Shaw on GPU 0, TXL and DeBERTa on
    # GPU 1 (each record now carries the host time per call, host_ms)
    mv .bench_state/attention.json /tmp/attention_committed.json 2>/dev/null
    (CUDA_VISIBLE_DEVICES=0 MECHS="t5 shaw" taskset -c 0-15 \
        bash benchmarks/h200_session.sh bench /tmp/m0 500 512,256,128 > /tmp/m0.out 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 MECHS="txl deberta_v3" taskset -c 16-31 \
        bash benchmarks/h200_session.sh bench /tmp/m1 500 512,256,128 > /tmp/m1.out 2>&1) &
    wait
    tail -4 /tmp/m0/bench.log /tmp/m1/bench.log
    tar czf "$OUT/call2.tgz" -C /tmp m0 m1 m0.out m1.out
    ;;
# call 5 (one nvidia-h200-x2): the table reduction's flat loop (templates/mechanism.py.j2, _reduce_table_kernel) —
# GPU 0: exactness (quick_timing --check, six specs at N = 128 and 1000), then the GPU suite's backward subset;
# GPU 1: per-kernel CUDA times, the tree before (.bench_state/reduce_old.j2) against the flat loop and the flat
# loop with 3 stages (.bench_state/sm90_reduce_s3.json), alternating fresh processes. reduce_old.j2 was
# templates/mechanism.py.j2 of 5bda317; sm90_reduce_s3.json its relgen/tuning_tables/sm90.json with every reduce
# entry's num_stages set to 3; the flat loop: …_call5_template_reduce_flat.diff (not landed)
call5)
    t0=$SECONDS
    for t in old new new3; do
        rm -rf /tmp/t-$t && mkdir -p /tmp/t-$t && cp -r relgen benchmarks specs templates /tmp/t-$t/
    done
    cp .bench_state/reduce_old.j2 /tmp/t-old/templates/mechanism.py.j2
    cp .bench_state/sm90_reduce_s3.json /tmp/t-new3/relgen/tuning_tables/sm90.json
    mkdir -p /tmp/r5
    (export CUDA_VISIBLE_DEVICES=0; taskset -pc 0-15 $BASHPID > /dev/null
     PYTHONPATH=/tmp/t-new:$PYTHONPATH timeout 150 python3 /tmp/t-new/benchmarks/quick_timing.py --check \
         --specs shaw,txl,deberta_v3,t5,t5_decoder,wav2vec2_bert --seq-lens 128,1000 --json /tmp/r5/check.json \
         > /tmp/r5/check.log 2>&1
     timeout $((420 - (SECONDS - t0))) python3 -m pytest -v -n 8 tests/test_gpu.py tests/test_features.py \
         -k "packed or bitwise or every_backward_candidate or fp32_is_exact or every_map_kind or recompute or small" \
         -p no:warnings -p no:cacheprovider -rfE > /tmp/r5/gpu_tests.log 2>&1
     echo "tests exit $?" >> /tmp/r5/gpu_tests.log) &
    (export CUDA_VISIBLE_DEVICES=1; taskset -pc 16-31 $BASHPID > /dev/null
     for t in old new new3 new old; do
         [ $((SECONDS - t0)) -lt 320 ] || break
         PYTHONPATH=/tmp/t-$t:$PYTHONPATH timeout 100 python3 /tmp/t-$t/benchmarks/profile_kernels.py \
             --specs shaw,deberta_v3,t5,txl --seq-lens 128,512,8192 --json /tmp/r5/prof_$t.jsonl \
             >> /tmp/r5/prof.log 2>&1
     done) &
    wait
    tail -3 /tmp/r5/gpu_tests.log; tail -12 /tmp/r5/check.log
    tar czf "$OUT/call5.tgz" -C /tmp r5
    ;;
esac
# call 3 (one nvidia-h200): where the backward's host time goes on the H200's host (cProfile, syncs every
# queued_calls so a full launch queue is not counted as host time)
#   for a in "t5 128" "t5 512" "deberta_v3 256" "shaw 128"; do set -- $a
#       python3 benchmarks/host_path.py --spec $1 --seq-len $2 --profile >> $OUT/host_profile.jsonl; done
# call 4 (the same nvidia-h200): the signature cache's host time on the H200's host, the tree before it (71415e8,
# `git archive 71415e8 relgen specs templates` unpacked in .bench_state/old) against the current one, three
# alternating rounds in fresh processes
#   for r in 1 2 3; do order="old new"; [ $((r % 2)) = 0 ] && order="new old"
#     for t in $order; do [ $t = old ] && p=$PWD/.bench_state/old || p=$PWD
#       for a in "t5 512" "shaw 128" "deberta_v3 256" "txl 128"; do set -- $a
#         PYTHONPATH=$p:/tmp/site python3 benchmarks/results/h200/sessions/2026-11-30_seventeenth_host_ab.py \
#           --spec $1 --seq-len $2 --tree $t >> $OUT/host_ab.jsonl; done; done; done
# next (prepared, not run): the fully flat table reduction (…_reduce_fullflat.diff, `git apply` on 10f3861's
# template; CPU: test_kernels, test_features, test_vectorization 152 passed) against the tree, 2 and 3 stages
# (sm90.json with every reduce entry at num_stages 3, as .bench_state/sm90_reduce_s3.json was made), per-kernel
# times at 128 … 8K, then exactness; on one GPU (~6 min):
#   for t in cur flat flat3; do mkdir -p /tmp/t-$t && cp -r relgen benchmarks specs templates /tmp/t-$t/; done
#   (cd /tmp/t-flat && git apply --directory=. $PWD/…_reduce_fullflat.diff)  # likewise t-flat3 + the s3 table
#   for t in cur flat flat3 flat cur; do PYTHONPATH=/tmp/t-$t:$PYTHONPATH python3 /tmp/t-$t/benchmarks/profile_kernels.py \
#       --specs shaw,deberta_v3,t5,txl --seq-lens 128,512,2048,8192 >> $OUT/prof.log; done
#   PYTHONPATH=/tmp/t-flat:$PYTHONPATH python3 /tmp/t-flat/benchmarks/quick_timing.py --check --seq-lens 128,1000 \
#       --specs shaw,txl,deberta_v3,t5,t5_decoder,wav2vec2_bert
