#!/usr/bin/env bash
# A/B of two kernel templates on one GPU, same process settings, alternating rounds (a development aid):
#
#   bash benchmarks/ab_templates.sh OTHER_TEMPLATE OUT.jsonl [ROUNDS] [SPECS] [LENGTHS]
#
# times relgen (benchmarks/quick_timing.py: fwd and bwd, 16K tokens, fp16) with templates/mechanism.py.j2 as it
# is ("current") and with OTHER_TEMPLATE in its place ("other"), ROUNDS times each (default 2), and appends one JSON
# line per measurement, tagged with the template and round, to OUT.jsonl. The working template is restored on exit.
# The runtime caches generated modules by their source's hash, so the two never share a kernel.
set -u
other=${1:?template to compare with}
out=${2:?output .jsonl}
rounds=${3:-2}
specs=${4:-shaw,txl,deberta_v3,t5}
lengths=${5:-512,1024,8192}
current=$(mktemp /tmp/current-XXXX.j2)
cp templates/mechanism.py.j2 "$current"
trap 'cp "$current" templates/mechanism.py.j2' EXIT
for round in $(seq "$rounds"); do
    for which in other current; do
        source=$current
        [ "$which" = other ] && source=$other
        cp "$source" templates/mechanism.py.j2
        python3 benchmarks/quick_timing.py --specs "$specs" --seq-lens "$lengths" 2>>"$out.err" \
            | sed "s/^{/{\"template\": \"$which\", \"round\": $round, /" >> "$out"
    done
done
