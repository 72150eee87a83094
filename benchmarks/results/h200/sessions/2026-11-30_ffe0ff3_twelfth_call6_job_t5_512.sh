# twelfth session call 6 (one H200, nothing else running): T5 at N = 512, relgen against FlexAttention on the
# decomposition (its closest peer there) and plain SDPA, in one run; call 5 read relgen's forward at 0.264 ms with a
# second job on the host's other GPU (0.170 ms alone in the eleventh session)
set -u
export PYTHONUNBUFFERED=1
SYSTEMS=relgen,flex_decomp,sdpa_plain MECHS="t5" WARM_S=150 bash benchmarks/h200_session.sh bench /tmp/u0 250 512 > /tmp/u0.out 2>&1
cp /tmp/u0.out /tmp/u0/
tar czf $OUT/u0.tgz -C /tmp u0
