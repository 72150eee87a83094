# Compiled peers under max-autotune-no-cudagraphs for the (mechanism, N, system) groups given as
# "mech:N:system ..." in PEERS (not GROUPS: a bash builtin): compile-only processes first (nice'd, one per group, WARM_END s from start),
# then one measuring run per mechanism over those lengths until END s. Needs $w (state dir) and $o.
set -u
sys=flex_decomp,flex,compiled
for g in $PEERS; do
    IFS=: read -r m n s <<< "$g"
    d=/tmp/warm_${m}_${n}_$s; mkdir -p $d; cp .bench_state/attention.json $d/
    TORCHINDUCTOR_COMPILE_THREADS=${THREADS:-2} nice -n 10 timeout $((WARM_END - SECONDS)) python3 -m relgen.bench \
        --out $d --mechanisms $m --systems $s --seq-lens $n --flex-mode max-autotune --process-per group --no-check \
        --min-reps 1 --warmup-ms 1 --rep-ms 1 --timeout 600 --resume > $d.log 2>&1 &
done
