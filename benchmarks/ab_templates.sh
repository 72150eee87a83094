#!/usr/bin/env bash
# A/B of two kernel templates on one GPU, alternating rounds in fresh processes (a development aid):
#
#   bash benchmarks/ab_templates.sh OTHER OUT.jsonl [ROUNDS] [SPECS] [LENGTHS] [QUICK_TIMING_OPTIONS]
#
# times relgen (benchmarks/quick_timing.py: fwd and bwd, 16K tokens, fp16) from this tree ("current") and from a
# copy of it ("other"), ROUNDS times each (default 2), and appends one JSON line per measurement, tagged with the
# template and the round, to OUT.jsonl. OTHER is a template file, which replaces the copy's
# templates/mechanism.py.j2, or a tree (a directory, e.g. `git archive main | tar -x -C DIR`), whose relgen/ and
# templates/ replace the copy's (templates/parts/ and the runtime they launch through change together). The tree
# itself is never changed, so other processes may compile from it meanwhile.
set -u
other=${1:?template or tree to compare with}
out=${2:?output .jsonl}
rounds=${3:-2}
specs=${4:-shaw,txl,deberta_v3,t5}
lengths=${5:-512,1024,8192}
options=${6:-}  # e.g. "--dropout 0.1"
copy=$(mktemp -d /tmp/ab-other-XXXX)
cp -r relgen benchmarks specs templates "$copy/"
if [ -d "$other" ]; then
    rm -rf "$copy/relgen" "$copy/templates"
    cp -r "$other/relgen" "$other/templates" "$copy/"
else
    cp "$other" "$copy/templates/mechanism.py.j2"
fi
for round in $(seq "$rounds"); do
    for which in other current; do
        root=$PWD
        [ "$which" = other ] && root=$copy
        PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 "$root/benchmarks/quick_timing.py" --specs "$specs" \
            --seq-lens "$lengths" $options 2>>"$out.err" | sed "s/^{/{\"template\": \"$which\", \"round\": $round, /" >> "$out"
    done
done
