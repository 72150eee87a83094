# fifteenth session: the four device calls as they ran (one nvidia-h200-x2, held across all four: each call was
# issued within the machine's 30 s idle release of the one before, so the compile caches in /tmp carried over).
# Tree b885a4c + the `compile` phase of benchmarks/h200_session.sh (sources 4306f704a31127d0). The version that
# ran also exported TORCHINDUCTOR_CACHE_DIR=/tmp/relgen-inductor and had a `pack` phase (both removed after call
# 1: the cache was 3.3 GB, 217 MB as tar.gz without inductor's triton/, over the 64 MB a call returns).
# .bench_state/attention.json was moved aside before call 2, so that nothing was resumed.
# every call started with:
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD

# call 1 (543 s): compile only, N = 512 ... 4K
B=495; L=512,1024,2048,4096
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh compile /tmp/g0 $B $L > /tmp/g0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh compile /tmp/g1 $B $L > /tmp/g1.out 2>&1) &
wait

# call 2 (470 s): every system at N = 512 ... 4K, one share of the mechanisms per GPU
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/m0 505 512,1024,2048,4096 > /tmp/m0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh bench /tmp/m1 505 512,1024,2048,4096 > /tmp/m1.out 2>&1) &
wait

# call 3 (276 s): compile, then every system, at N = 256, 128
L=256,128
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh compile /tmp/h0 250 $L > /tmp/h0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh compile /tmp/h1 250 $L > /tmp/h1.out 2>&1) &
wait
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/n0 230 $L > /tmp/n0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh bench /tmp/n1 230 $L > /tmp/n1.out 2>&1) &
wait

# call 4 (375 s, the device time left): the same at N = 8K, cut short by the budgets
L=8192
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh compile /tmp/k0 215 $L > /tmp/k0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh compile /tmp/k1 215 $L > /tmp/k1.out 2>&1) &
wait
(CUDA_VISIBLE_DEVICES=0 MECHS="deberta_v3 txl" taskset -c 0-15 bash benchmarks/h200_session.sh bench /tmp/p0 150 $L > /tmp/p0.out 2>&1) &
(CUDA_VISIBLE_DEVICES=1 MECHS="t5 shaw" taskset -c 16-31 bash benchmarks/h200_session.sh bench /tmp/p1 150 $L > /tmp/p1.out 2>&1) &
wait

# then, here:
# python -m relgen.bench --merge benchmarks/results/h200/sessions/2026-11-30_b885a4c_fifteenth_call*_attention_*.json \
#     --out benchmarks/results/h200
