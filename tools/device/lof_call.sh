# any one GPU (~3 min; guarded to end by END, default 570 s): Engine.generate submitting its
# batch longest output first (phaseflip/scheduler/scheduler.py longest_output_first) against
# the workload's own order, FP8 offline, PAIRS interleaved pairs (default 1). On the CPU with
# a null forward the 1 000-request run takes 1 024 steps against 1 055
# (docs/results/2026-12-06/cpu-longest-first/). Results: $OUT/lof.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
PAIRS=${PAIRS:-1} offline_ab phaseflip/engine/engine.py lof arrival \
  's/for i in longest_output_first(\[p.max_new_tokens for p in params\]):/for i in range(len(order)):/'
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf lof.tgz x && rm -rf x
