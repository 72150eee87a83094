# GPU 0: compile pass, A/B of the template against the one before INNER, then the tuning tables
set -u
o=$OUT/g0; mkdir -p $o
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1
for s in shaw txl deberta_v3 t5; do
    timeout 170 python3 -m relgen tune specs/$s.yaml --seq-lens 512 8192 --out /tmp/w_$s.json > /tmp/w_$s.log 2>&1 &
done
timeout 170 bash benchmarks/ab_templates.sh .bench_state/mechanism_before.j2 /tmp/ab_warm.jsonl 1 shaw,txl,deberta_v3,t5 512,8192 &
wait
timeout 130 bash benchmarks/ab_templates.sh .bench_state/mechanism_before.j2 $o/ab.jsonl 2 shaw,txl,deberta_v3,t5 512,1024,8192
timeout 225 python3 -m relgen tune specs/shaw.yaml specs/txl.yaml specs/deberta_v3.yaml specs/t5.yaml \
    --seq-lens 64 128 384 512 768 1024 2048 4096 8192 --budget-s 195 > $o/tune.log 2>&1
echo "tune exit $?" >> $o/tune.log
cp relgen/tuning_tables/sm90.json $o/
