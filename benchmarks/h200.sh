#!/usr/bin/env bash
# The H200 runs, in phases that each fit one ten-minute job (repo root on the GPU machine, pydantic
# on PYTHONPATH). Compilation is done in parallel processes first (their timings are thrown away), so the
# measurements that follow run one at a time on warm caches.
#
#   bash benchmarks/h200.sh verify OUT                  GPU test suite: every test marked gpu
#                                                                (VERIFY_TESTS: the files, default all of tests/;
#                                                                VERIFY_WORKERS: pytest-xdist workers, default 6,
#                                                                since several tests hold FP64 references of
#                                                                tens of GiB; VERIFY_S: the time limit)
#   bash benchmarks/h200.sh tune OUT [LENGTHS]           tuning tables and the per-kernel profile
#                                                                (TUNE_S: seconds of tuning, default 130)
#   bash benchmarks/h200.sh bench OUT SECONDS [N,...]    relgen bench against the peers (resumes from
#                                                                .bench_state/attention.json when present;
#                                                                WARM_S=S first compiles in parallel for S s;
#                                                                MECHS="shaw t5" restricts the mechanisms, so
#                                                                two GPUs can each take a share: see NOTES.md;
#                                                                SYSTEMS=relgen,sdpa_plain the systems;
#                                                                FLEX_MODE=default the compiled peers' mode;
#                                                                WARM_THREADS inductor's compile workers per
#                                                                compile-only process; MEASURE_TIMEOUT_S)
#   bash benchmarks/h200.sh compile OUT SECONDS [N,...]  compile only, for the bench of the next call on
#                                                                the same machine (the caches live in /tmp; the
#                                                                machine stays only while calls follow within its
#                                                                idle release): one process per (mechanism, N,
#                                                                compiled system) and one for the rest of each
#                                                                (mechanism, N), COMPILE_JOBS at a time (12),
#                                                                lengths in the order given, stopped after SECONDS
#   bash benchmarks/h200.sh ablation OUT SECONDS [N,...]  Table 7: relgen with each component switched off
#                                                                next to full relgen (default N = 8192; MECHS as
#                                                                for bench)
#
# verify writes OUT/gpu_tests.log and gpu_figures.jsonl; tune writes OUT/tune.log, sm90.json (also left in
# relgen/tiles/tuning_tables/) and profile.json; bench writes OUT/attention.json, bench.log and (with WARM_S) warm.log
# only (a job brings back at most 8 files: two bench shares with plots lost one share's results once; render
# the report here with `python -m relgen.bench --report-only`). Every phase also writes OUT/gpu.txt.
set -u
phase=${1:?phase: verify, tune, bench, compile or ablation}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 RELGEN_GPU_REPORT="$out/gpu_figures.jsonl"
read -r -a specs <<< "${MECHS:-shaw txl deberta_v3 t5}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv > "$out/gpu.txt"
# the device's copy of .git can be stale: fingerprint the sources that ran instead (files in C-locale order: the
# device's locale sorts "__init__.py" elsewhere, which changed the fingerprint of the same files)
echo "sources sha256: $(LC_ALL=C; cat templates/*.j2 templates/parts/*.j2 relgen/*.py relgen/*/*.py | sha256sum | cut -c1-16)" >> "$out/gpu.txt"
# torch.compile's mode for the compiled peers: the protocol's max-autotune-no-cudagraphs compiles for 30-90 s per
# graph, so compile first (WARM_S, or the compile phase); FLEX_MODE=default is the faster, non-protocol choice
flex_mode=${FLEX_MODE:-max-autotune}
systems=${SYSTEMS:-relgen,sdpa_plain,sdpa,eager,flex_decomp,flex,compiled}

# The compile-only processes: one per (mechanism, N, compiled system), and one for the rest of a (mechanism, N).
# A max-autotune compile takes 30 s to several minutes, so the compiled systems must not queue behind each other.
compile_shares() {  # the systems torch.compile builds (SYSTEMS[...]["compiled"]) one by one, then the rest
    local compiled='flex|flex_decomp|compiled'
    echo "$systems" | tr ',' '\n' | grep -xE "$compiled" | tr '\n' ' '
    echo "$systems" | tr ',' '\n' | grep -vxE "$compiled" | paste -sd, -
}
compile_only() {  # DIR MECHANISM N SHARE SECONDS THREADS [relgen bench options]: timings thrown away (one
    # unchecked run); what stays is on disk. Its log: DIR.log
    local d=$1 limit=$5 threads=$6
    TORCHINDUCTOR_COMPILE_THREADS=$threads nice -n 10 timeout "$limit" \
        python3 -m relgen.bench --out "$d" --mechanisms "$2" --systems "$4" --seq-lens "$3" \
        --flex-mode "$flex_mode" --process-per group --no-check --min-reps 1 --warmup-ms 1 --rep-ms 1 \
        --timeout "$limit" "${@:7}" > "$d.log" 2>&1
}

if [ "$phase" = verify ]; then
    # -v: each test's outcome is logged as it finishes, so a run cut by the timeout still names its failures
    # -m gpu: the CPU tests of these files build CPU tensors, which a CUDA host's kernels refuse
    read -r -a files <<< "${VERIFY_TESTS:-tests/}"
    timeout "${VERIFY_S:-540}" python3 -m pytest -v -m gpu -n "${VERIFY_WORKERS:-6}" "${files[@]}" -p no:warnings \
        -p no:cacheprovider -rfE > "$out/gpu_tests.log" 2>&1
    echo "tests exit $?" >> "$out/gpu_tests.log"
    tail -5 "$out/gpu_tests.log"
elif [ "$phase" = tune ]; then
    lengths=${3:-"512 2048 8192"}
    for s in "${specs[@]}"; do  # compile every tuning candidate and profiled kernel (timings discarded; N is a
        # runtime argument, so two lengths compile what every bucket runs)
        (timeout 240 python3 -m relgen tune "specs/$s.yaml" --seq-lens 512 8192 --out "/tmp/warm_$s.json" \
            > "/tmp/warm_tune_$s.log" 2>&1
         timeout 60 python3 benchmarks/profile_kernels.py --specs "$s" --seq-lens 1024,8192 \
            > "/tmp/warm_profile_$s.log" 2>&1) &
    done
    wait
    timeout $((${TUNE_S:-130} + 20)) python3 -m relgen tune $(printf 'specs/%s.yaml ' "${specs[@]}") \
        --seq-lens $lengths --budget-s "${TUNE_S:-130}" \
        > "$out/tune.log" 2>&1
    echo "tune exit $?" >> "$out/tune.log"
    cp relgen/tiles/tuning_tables/sm90.json "$out/sm90.json" 2>/dev/null
    timeout 80 python3 benchmarks/profile_kernels.py --seq-lens 1024,8192 --host-profile \
        --json "$out/profile.json" > "$out/profile.log" 2>&1
    tail -3 "$out/tune.log"
elif [ "$phase" = bench ]; then
    budget=${3:?seconds}
    lengths=${4:-512,2048,8192}
    warm=${WARM_S:-0}  # seconds of parallel compile-only runs first (torch.compile and Triton disk caches)
    work=$(mktemp -d /tmp/relgen-bench-XXXX)  # report and plots stay on the device machine
    if [ "$warm" -gt 0 ]; then
        # all at once; only what the state lacks is compiled (--resume)
        for s in "${specs[@]}"; do
            for n in ${lengths//,/ }; do
                for share in $(compile_shares); do
                    d="/tmp/warm_bench_${s}_${n}_${share//,/+}"
                    mkdir -p "$d"
                    [ -f .bench_state/attention.json ] && cp .bench_state/attention.json "$d/"
                    compile_only "$d" "$s" "$n" "$share" "$warm" "${WARM_THREADS:-4}" --resume &
                done
            done
        done
        wait
        tail -n 40 /tmp/warm_bench_*.log > "$out/warm.log"  # how long each compile took
        budget=$((budget - warm))
    fi
    # a run continues what an earlier call measured: its attention.json travels in .bench_state/ (git-ignored)
    [ -f .bench_state/attention.json ] && cp .bench_state/attention.json "$work/attention.json"
    timeout $((budget + 30)) python3 -m relgen.bench --out "$work" --seq-lens "$lengths" \
        --systems "$systems" --flex-mode "$flex_mode" \
        --process-per group --timeout "${MEASURE_TIMEOUT_S:-40}" --min-reps 3 --warmup-ms 10 --rep-ms 50 \
        --budget-s "$budget" --resume \
        --mechanisms "$(IFS=,; echo "${specs[*]}")" \
        > "$out/bench.log" 2>&1
    echo "bench exit $?" >> "$out/bench.log"
    cp "$work/attention.json" "$out/attention.json"
    tail -40 "$out/bench.log"
elif [ "$phase" = compile ]; then
    budget=${3:?seconds}
    lengths=${4:-512,2048,8192}
    deadline=$((SECONDS + budget))
    : > "$out/compile.log"
    for n in ${lengths//,/ }; do
        for s in "${specs[@]}"; do
            for share in $(compile_shares); do
                while [ "$(jobs -rp | wc -l)" -ge "${COMPILE_JOBS:-12}" ]; do wait -n; done
                left=$((deadline - SECONDS))
                [ "$left" -gt 20 ] || break 3
                (d="/tmp/compile_${s}_${n}_${share//,/+}"
                 began=$SECONDS
                 compile_only "$d" "$s" "$n" "$share" "$left" "${WARM_THREADS:-2}"
                 echo "$s $n $share: exit $? after $((SECONDS - began)) s; $(grep -c '^\[' "$d.log") of" \
                      "$(grep -o '[0-9]* measurements' "$d.log" | head -1)" >> "$out/compile.log") &
            done
        done
    done
    wait
    cat "$out/compile.log"
elif [ "$phase" = ablation ]; then
    budget=${3:?seconds}
    timeout $((budget + 30)) python3 -m relgen.bench --ablation --out "$out" --seq-lens "${4:-8192}" \
        --mechanisms "$(IFS=,; echo "${specs[*]}")" --process-per group --timeout 60 --min-reps 3 --warmup-ms 10 \
        --rep-ms 50 --budget-s "$budget" > "$out/ablation.log" 2>&1
    echo "ablation exit $?" >> "$out/ablation.log"
    tail -20 "$out/ablation.log"
else
    echo "unknown phase $phase" >&2
    exit 2
fi
