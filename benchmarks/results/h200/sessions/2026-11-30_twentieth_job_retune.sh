#!/bin/bash
# job_retune.sh MECH OUT TUNE_S CHECK_NS N [N2 ...]: one GPU's share of calls 4 and 5 (twentieth session).
# relgen tune the mechanism's buckets N N2 … into a copy of the table, merge the new entries into
# relgen/tuning_tables/sm90.json (under a lock: the other GPU's share merges into the same file), then every
# system at N compiled and measured side by side, nothing resumed; last, quick_timing.py's FP64 check (every
# gradient) at the lengths CHECK_NS.
mech=$1 out=$2 tune_s=$3 check_ns=$4 n=$5; shift 4
mkdir -p "$out"
table=relgen/tuning_tables/sm90.json
cp "$table" "$out/tuned.json"
cp "$table" "$out/before.json"
timeout $((tune_s + 40)) python3 -m relgen tune "specs/$mech.yaml" --seq-lens "$@" --budget-s "$tune_s" \
    --out "$out/tuned.json" > "$out/tune.log" 2>&1
echo "tune exit $?"; tail -4 "$out/tune.log"
# only what this tuner changed against its own starting copy (call 4 compared with the live table instead, so the
# second share to finish wrote the first share's entries back to their old values)
(flock 9; python3 - "$out/tuned.json" "$table" "$out/before.json" <<'PY'
import json, sys
from pathlib import Path
from relgen.tune import write_entry
tuned, table = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
before = json.loads(Path(sys.argv[3]).read_text())
for key, entry in tuned.items():
    if key != "_timings" and tuned["_timings"].get(key) != before.get("_timings", {}).get(key):
        write_entry(table, key, entry, tuned["_timings"][key])
        print("merged", key, json.dumps(entry))
PY
) 9> /tmp/table.lock
COMPILE_JOBS=4 MECHS=$mech bash benchmarks/h200_session.sh compile "$out" 180 "$n"
MECHS=$mech bash benchmarks/h200_session.sh bench "$out" 150 "$n"
timeout 45 python3 benchmarks/quick_timing.py --check --specs "$mech" --seq-lens "$check_ns" > "$out/check.log" 2>&1
echo "check exit $?" >> "$out/check.log"
