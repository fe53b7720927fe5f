# one H200 (nvidia-h200; ~8 min, guarded to end by 570 s): the decode tail's skinny GEMMs.
# The offline run's last ~500 decode steps carry 16-99 sequences (5.08 ms a step against ~2 ms
# of FP8 weights); the skinny kernel's W8A8 table for the 16/32/64-row buckets was tuned
# against the clamped x rows. Here: the shipped table timed, the 16/32/64 buckets re-tuned
# against the masked kernel (the tuned JSON is the whole shipped table with those rows
# replaced), then FP8 offline A/B interleaved: shipped / re-tuned, two pairs.
# Run after h200_fp8_call.sh (ship its tile table first if it won: this call reads the tree's).
# step (est. / skipped under MIN s left / killed at MAX s): lk_shipped 40/30/120,
# tune_sk 240/120/330, off_{shipped,tuned}{1,2} 55/60/110 each.
# Results: $OUT/h200_fp8_call2.tgz: x/<step>.log, lk_*.json, lk_tune.tuned.json, off_*.json, summary.txt.
. tools/device/lib.sh
S=phaseflip/assets/kernel_configs/skinny_linear_nvidia_h200.json
cp $S /tmp/skinny_old.json
LK="--fp8-weights --w8a8 --m 16,24,32,48,64 --shapes llama.qkv,llama.o,llama.gate_up,llama.down --no-eager --no-model-pass"
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
step lk_shipped 30 120 0 "python3 -m benchmarks.linear_kernels $LK --tuned-json $S --out $X/lk_shipped.json"
step tune_sk 120 330 30 "python3 -m benchmarks.linear_kernels $LK --tuned-json $S --tune --m 16,32,64 --out $X/lk_tune.json"
[ -s $X/lk_tune.tuned.json ] || cp /tmp/skinny_old.json $X/lk_tune.tuned.json
arm() { case $1 in shipped) cp /tmp/skinny_old.json $S;; tuned) cp $X/lk_tune.tuned.json $S;; esac; }
for i in 1 2; do for a in shipped tuned; do
  arm $a; step off_$a$i 60 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
python3 tools/device/summary.py $X fp8 offline | tee $X/summary.txt
cp /tmp/skinny_old.json $S
cd $OUT && tar czf h200_fp8_call2.tgz x && rm -rf x
