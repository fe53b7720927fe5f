# one GPU (~9 min, guarded to end by END, default 570 s): the decode step's host work before
# and after 7fa6a38 + the scheduler's decode rows (DecodeStream text, deltas and plan rows
# without per-request property calls), FP8 offline, interleaved on one machine:
#   prof_{before,after}{1,2}  profile_offline --host-clock --gpu-clock (host phases and the
#                             GPU's idle time before each step, by kind and batch size)
#   off_{before,after}{1,2}   bench_offline, the 1 000-request command of record
# The "before" files travel in .carry/before (the device copy has no git history):
#   for f in <FILES>; do git show 700656a:$f > .carry/before/$(basename $f); done
# step (est. / skipped under MIN s left / killed at MAX s): prof_* 50/50/110, off_* 45/50/100.
# Results: $OUT/host_ab_call.tgz: x/<step>.log, prof_*.json, off_*.json, summary.txt.
. tools/device/lib.sh
FILES="phaseflip/sampling/detokenize.py phaseflip/engine/output_processor.py phaseflip/scheduler/scheduler.py"
mkdir -p /tmp/before /tmp/after
for f in $FILES; do cp $f /tmp/after/; cp .carry/before/$(basename $f) /tmp/before/ || exit; done
arm() { for f in $FILES; do cp /tmp/$1/$(basename $f) $f; done; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for i in 1 2; do for a in before after; do arm $a
  step prof_$a$i 50 110 12 "python3 -m benchmarks.profile_offline $OFF $F8 --host-clock --gpu-clock --out $X/prof_$a$i.json"; done; done
for i in 1 2; do for a in before after; do arm $a
  step off_$a$i 50 100 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
arm after
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf host_ab_call.tgz x && rm -rf x
