# any one GPU (~3 min; guarded to end by END, default 570 s): Engine.generate submitting its
# batch longest output first (phaseflip/scheduler/scheduler.py longest_output_first) against
# the workload's own order, FP8 offline, PAIRS interleaved pairs (default 1). On the CPU with
# a null forward the 1 000-request run takes 1 024 steps against 1 055
# (docs/results/2026-12-06/cpu-longest-first/). Results: $OUT/lof.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
E=phaseflip/engine/engine.py; cp $E /tmp/engine.py
arm() { cp /tmp/engine.py $E; [ $1 = arrival ] && sed -i \
  's/for i in longest_output_first(\[p.max_new_tokens for p in params\]):/for i in range(len(order)):/' $E
  grep -c "longest_output_first(\[" $E; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for i in $(seq 1 ${PAIRS:-1}); do for a in lof arrival; do arm $a
  step off_$a$i 40 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
cp /tmp/engine.py $E
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf lof.tgz x && rm -rf x
