# twelfth session call 1, GPU 1: the ablations (Table 7) at 8K, with the in-tile variant's own tiles (fcb05bd), cores 16-31
set -u
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
taskset -c 16-31 bash benchmarks/h200_session.sh ablation /tmp/p1 430 > /tmp/p1.out 2>&1
cp /tmp/p1.out /tmp/p1/
tar czf $OUT/p1.tgz -C /tmp p1
