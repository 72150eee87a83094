#!/bin/bash
# Nineteenth session's device calls as they ran (six calls on nvidia-h200-x2 machines, 1789 s of device time).
# Each started: python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD;
# Variant trees lived in .bench_state/var3/ (carried in calls 1-2): copies of relgen/ templates/ specs/ and
# benchmarks/*.py; head = git archive of f57b0be (the session's start), merge = head + …eighteenth_template_merge.diff,
# ilv = head + …nineteenth_template_interleave.diff (Z̃^Q's end-column tiles ahead, the other column tiles written
# by the merged saturated loop, the band after it), ilvtop = ilv with that write at the top of the loop body instead
# of after the PV product, ilv32 / head32 / merge32 = ilv / head / merge with every query/fp16/d64 entry's projection
# column tile (block_w) at 32.
# job.sh ROLE OUT: ROLE=time: 3 rounds of
#   PYTHONPATH=$V/$v:$PYTHONPATH python3 $V/$v/benchmarks/quick_timing.py --specs shaw --seq-lens 8192
# over "head merge ilv ilvtop ilv32"; ROLE=check: quick_timing.py --check --descriptors --specs shaw,wav2vec2_bert
# --seq-lens 300,1000,2048 on ilv, ilvtop, ilv32, then 2 rounds of --specs shaw --seq-lens 512,1024,2048,4096 and
# --specs wav2vec2_bert --seq-lens 8192 over "head ilv ilv32".
# Call 1
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 bash .bench_state/var3/job.sh time $OUT &
CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var3/job.sh check $OUT; wait
# Call 2: plain attention in relgen's design with 256-row query blocks (ceil256.py: benchmarks/plain_ceiling.py's
# plain_forward, TMA on, configs 128x64 w4 s3/s4 and 256x{32,64,128} w8 s2-s4, two rounds beside plain SDPA), and
# Shaw at 512/1K/2K/8K over head, head32, merge32, ilv32 (two rounds of quick_timing.py)
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 .bench_state/var4/ceil256.py > $OUT/ceil256.jsonl &
CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 bash .bench_state/var4/job1.sh $OUT; wait
# Call 3 (tree f57b0be, nothing carried but the wheels): Shaw's buckets 384-1K retuned
CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python3 -m relgen tune specs/shaw.yaml --seq-lens 512 768 --budget-s 500 --out $OUT/shaw_a.json &
CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 python3 -m relgen tune specs/shaw.yaml --seq-lens 1024 384 --budget-s 500 --out $OUT/shaw_b.json; wait
# (here: the four entries written into relgen/tuning_tables/sm90.json with relgen.tune.write_entry)
# Call 4 (the retuned table): every system at 512 (GPU 0) and 1K (GPU 1), compiled then measured in one call,
# nothing resumed; then the FP64 check of the retuned buckets
(export CUDA_VISIBLE_DEVICES=0; COMPILE_JOBS=4 MECHS=shaw taskset -c 0-15 bash benchmarks/h200_session.sh compile $OUT/g0 230 512
 MECHS=shaw taskset -c 0-15 bash benchmarks/h200_session.sh bench $OUT/g0 200 512) &
(export CUDA_VISIBLE_DEVICES=1; COMPILE_JOBS=4 MECHS=shaw taskset -c 16-31 bash benchmarks/h200_session.sh compile $OUT/g1 230 1024
 MECHS=shaw taskset -c 16-31 bash benchmarks/h200_session.sh bench $OUT/g1 200 1024
 taskset -c 16-31 python3 benchmarks/quick_timing.py --check --descriptors --specs shaw --seq-lens 384,500,700,1000); wait
# merged here: python -m relgen.bench --merge …_call4_attention_shaw_512.json …_call4_attention_shaw_1024.json --out benchmarks/results/h200
# Call 5: the GPU suite on the retuned table
bash benchmarks/h200_session.sh verify $OUT
# Call 6 (cut by its 330 s limit; nothing changed): DeBERTa's 512 / 1K entries retuned, merged, then compiled and
# benched in the same call; the tuner's 165 s budget ran out first (no entry written), the bench did not finish
(CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 timeout 200 python3 -m relgen tune specs/deberta_v3.yaml --seq-lens 512 --budget-s 165 --out $OUT/d512.json) &
(CUDA_VISIBLE_DEVICES=1 taskset -c 16-31 timeout 200 python3 -m relgen tune specs/deberta_v3.yaml --seq-lens 1024 --budget-s 165 --out $OUT/d1k.json); wait
# … then the entries merged with relgen.tune.write_entry and, per GPU, h200_session.sh compile /tmp/gX 95 N and
# bench /tmp/gX 70 N with MECHS=deberta_v3 (not reached in full)
