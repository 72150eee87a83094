# one share of the compiled peers under max-autotune on one GPU: a.sh GPU NAME MECHS LENGTHS [BUDGET]
# (WARM_S, WARM_THREADS, MEASURE_TIMEOUT_S from the environment)
set -u
gpu=$1; name=$2; mechs=$3; lengths=$4; budget=${5:-540}
CUDA_VISIBLE_DEVICES=$gpu SYSTEMS=${SYSTEMS:-flex_decomp,flex,compiled} WARM_S=${WARM_S:-330} WARM_THREADS=${WARM_THREADS:-2} \
    MEASURE_TIMEOUT_S=${MEASURE_TIMEOUT_S:-120} MECHS="$mechs" \
    bash benchmarks/h200_session.sh bench /tmp/$name $budget $lengths > /tmp/$name.out 2>&1
cp /tmp/$name.out /tmp/$name/
tar czf $OUT/$name.tgz -C /tmp $name
