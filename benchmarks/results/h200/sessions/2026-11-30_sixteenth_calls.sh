# Sixteenth session's device calls (one nvidia-h200-x2 held across calls 1 and 2: call 2 is issued within the
# machine's 30 s idle release of call 1, so the compile caches and call 1's decision in /tmp carry over).
#   bash benchmarks/results/h200/sessions/2026-11-30_sixteenth_calls.sh call1|call2|call3|call4
# (calls 3 and 4: a second held nvidia-h200-x2, tree ff10762 + the GPU test of the bias in the inputs' dtype)
# every call starts with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# carry: .whl .bench_state (.bench_state/geometry_b.py = branch btilde2's relgen/geometry.py)
set -u
here=benchmarks/results/h200/sessions
started=$SECONDS

left() { echo $((505 - (SECONDS - started))); }  # seconds of call 1 still free for the A/B

ab() {  # GPU 1: the tree against the b̃-in-the-table's-dtype variant, three alternating rounds, then the rule
    local o=/tmp/ab t r order
    mkdir -p $o
    for t in cur b; do
        rm -rf /tmp/ab-$t && mkdir -p /tmp/ab-$t && cp -r relgen benchmarks specs templates /tmp/ab-$t/
    done
    cp .bench_state/geometry_b.py /tmp/ab-b/relgen/geometry.py
    for r in 1 2 3; do
        order="cur b"; [ $((r % 2)) = 0 ] && order="b cur"
        for t in $order; do  # each script's own tree first on sys.path (its folder's parent, then PYTHONPATH)
            [ "$(left)" -gt 150 ] || break 2
            PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout 90 python3 /tmp/ab-$t/benchmarks/host_path.py --spec t5 \
                --seq-len 512 2>>$o/ab.err | sed "s/^{/{\"tree\": \"$t\", \"round\": $r, /" >> $o/host_path.jsonl
            PYTHONPATH=/tmp/ab-$t:$PYTHONPATH timeout 120 python3 /tmp/ab-$t/benchmarks/quick_timing.py --specs t5 \
                --seq-lens 512,8192 --json $o/quick_${t}_$r.json >> $o/ab.log 2>>$o/ab.err
        done
    done
    PYTHONPATH=/tmp/ab-b:$PYTHONPATH timeout 100 python3 /tmp/ab-b/benchmarks/quick_timing.py --check \
        --specs t5,t5_decoder --seq-lens 1000 --json $o/check_b.json >> $o/ab.log 2>>$o/ab.err
    python3 $here/2026-11-30_sixteenth_ab_decide.py $o > $o/decision.txt 2>&1
    tail -1 $o/decision.txt > /tmp/ab_decision
    # what is left of the call: the tuner's candidates for T5 at 512 on the variant (64x128 among them), to read;
    # run from the variant's tree (python -m puts the working folder first on sys.path)
    cp relgen/tuning_tables/sm90.json /tmp/t5tune.json
    local n=$(left)
    [ "$n" -gt 60 ] && (cd /tmp/ab-b && timeout "$n" python3 -m relgen tune specs/t5.yaml --seq-lens 512 \
        --out /tmp/t5tune.json --budget-s $((n - 25)) > $o/tune_t5_512.log 2>&1)
    cp /tmp/t5tune.json $o/
}

case ${1:?call1 or call2} in
call1)  # compile at 8K (Shaw, TXL, T5) and T5's other lengths on GPU 0; the A/B on GPU 1
    (CUDA_VISIBLE_DEVICES=0 COMPILE_JOBS=12 MECHS="shaw txl t5" taskset -c 0-23 \
        bash benchmarks/h200_session.sh compile /tmp/k0 495 8192 > /tmp/k0.out 2>&1) &
    (CUDA_VISIBLE_DEVICES=0 COMPILE_JOBS=5 MECHS=t5 taskset -c 0-23 \
        bash benchmarks/h200_session.sh compile /tmp/k5 495 512,1024,2048,4096,256,128 > /tmp/k5.out 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1; taskset -pc 24-31 $BASHPID > /dev/null; ab) &
    wait
    cat /tmp/ab/decision.txt; cat /tmp/k0/compile.log /tmp/k5/compile.log
    tar czf "$OUT/call1.tgz" -C /tmp ab k0 k5 k0.out k5.out $(cd /tmp && ls -d compile_*.log)
    ;;
call2)  # every system at 8K for Shaw and TXL (GPU 0) and T5 (GPU 1), nothing resumed; T5's other lengths too
    # when call 1 adopted the variant (its relgen records then come from the variant's tree)
    mv .bench_state/attention.json /tmp/attention_committed.json 2>/dev/null
    lengths=8192,512
    if [ "$(cat /tmp/ab_decision 2>/dev/null)" = b ]; then
        cp .bench_state/geometry_b.py relgen/geometry.py
        lengths=8192,512,1024,2048,4096,256,128
    fi
    echo "decision: $(cat /tmp/ab_decision 2>/dev/null); T5 at $lengths"
    (CUDA_VISIBLE_DEVICES=0 MECHS="shaw txl" taskset -c 0-15 \
        bash benchmarks/h200_session.sh bench /tmp/m0 515 8192 > /tmp/m0.out 2>&1) &
    (CUDA_VISIBLE_DEVICES=1 MECHS=t5 taskset -c 16-31 \
        bash benchmarks/h200_session.sh bench /tmp/m1 515 $lengths > /tmp/m1.out 2>&1) &
    wait
    tail -4 /tmp/m0/bench.log /tmp/m1/bench.log
    tar czf "$OUT/call2.tgz" -C /tmp m0 m1 m0.out m1.out
    ;;
call3)  # GPU 0: the GPU suite; GPU 1: compile T5 at 512 and TXL at 8K, TXL at 8K side by side again (its
    # FlexAttention + decomposition backward crashed in call 2), T5's forward at 512 taken apart (host_path)
    mv .bench_state/attention.json /tmp/attention_committed.json 2>/dev/null
    (CUDA_VISIBLE_DEVICES=0 VERIFY_S=515 taskset -c 0-19 bash benchmarks/h200_session.sh verify /tmp/v > /tmp/v.out 2>&1) &
    (export CUDA_VISIBLE_DEVICES=1; taskset -pc 20-31 $BASHPID > /dev/null
     (MECHS=t5 COMPILE_JOBS=4 bash benchmarks/h200_session.sh compile /tmp/c5 260 512 > /tmp/c5.out 2>&1) &
     (MECHS=txl COMPILE_JOBS=4 bash benchmarks/h200_session.sh compile /tmp/c8 260 8192 > /tmp/c8.out 2>&1) &
     wait
     MECHS=txl bash benchmarks/h200_session.sh bench /tmp/x8 120 8192 > /tmp/x8.out 2>&1
     for r in 1 2 3; do
         timeout 60 python3 benchmarks/host_path.py --spec t5 --seq-len 512 2>/dev/null >> /tmp/host_path.jsonl
     done) &
    wait
    tail -n 6 /tmp/v/gpu_tests.log; cat /tmp/c5/compile.log /tmp/c8/compile.log; tail -n 16 /tmp/x8/bench.log
    tar czf "$OUT/call3.tgz" -C /tmp v c5 c8 x8 host_path.jsonl v.out c5.out c8.out x8.out
    ;;
call4)  # T5 at 512 side by side, every system, with nothing else running on the machine
    mv .bench_state/attention.json /tmp/attention_committed.json 2>/dev/null
    CUDA_VISIBLE_DEVICES=1 MECHS=t5 bash benchmarks/h200_session.sh bench /tmp/t512 150 512 > /tmp/t512.out 2>&1
    tail -n 16 /tmp/t512/bench.log
    tar czf "$OUT/call4.tgz" -C /tmp t512 t512.out
    ;;
esac

# call 5 (a fresh nvidia-h200, tree 4b5306b: T5's bucket-512 entry from call 1's tune): exactness of the new entry
# at N = 500 against the FP64 reference, then T5 at 512 side by side, then two repeats of relgen and FlexAttention
# + decomposition (run as one command line; here for the record):
#   mv .bench_state/attention.json /tmp/x.json
#   timeout 70 python3 benchmarks/quick_timing.py --check --specs t5,t5_decoder --seq-lens 500 > $OUT/check.log 2>&1
#   MECHS=t5 COMPILE_JOBS=4 bash benchmarks/h200_session.sh compile /tmp/c 110 512
#   MECHS=t5 bash benchmarks/h200_session.sh bench /tmp/t 40 512
#   for i in 1 2; do MECHS=t5 SYSTEMS=relgen,flex_decomp bash benchmarks/h200_session.sh bench /tmp/r$i 20 512; done
