#!/bin/bash
# cct.sh TEMPLATE NAME [spec] [config-for]: compile_check a template variant with TMA descriptors on
t=$1; n=$2; spec=${3:-shaw}; cf=${4:-8192}
rm -rf /tmp/tree_$n /tmp/ir_$n; mkdir -p /tmp/tree_$n /tmp/ir_$n
cd /work/main && cp -r relgen benchmarks specs templates /tmp/tree_$n/ && cp $t /tmp/tree_$n/templates/mechanism.py.j2
sed -i 's/^MIN_PAIRS = 1 << 28/MIN_PAIRS = 0/' /tmp/tree_$n/relgen/descriptors.py
cd /tmp/tree_$n && PYTHONPATH=/tmp/tree_$n RELGEN_DUMP_IR=/tmp/ir_$n python benchmarks/compile_check.py specs/$spec.yaml --seq-len ${SEQ:-640} --config-for $cf 2>&1 | grep -v "^tiles"
