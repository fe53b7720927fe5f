# any one GPU (~9 min; guarded to end by END, default 570 s): the LM head in FP8
# (--fp8-lm-head, phaseflip/model/lm_head.py) against the 16-bit head, FP8 weights + FP8 KV.
#   tests        tests/test_fp8_lm_head.py on the GPU (bf16, decode graphs, the FP8 GEMMs
#                at the head's rows; its tp2 and flip tests stay on the CPU over gloo)
#   off_*        FP8 offline, PAIRS interleaved pairs (default 2): lmh = --fp8-lm-head,
#                head16 = the default (also the card's FP8 figure with padding, longest
#                first and the o/down fold)
#   lat_*        FP8 bench_latency batch 1 and 64, lmh then head16 (batch 1: the head is
#                1.05 GB of the ~9 GB a step reads in bf16)
#   acc          benchmarks.fp8_accuracy on the GPU against a bf16 engine (w8, kv8, w8kv8,
#                w8kv8lm8; docs/quantization.md has only CPU figures)
#   off_bf16     bf16 offline once (the card's figure with longest first), if time is left
# Results: $OUT/lmh.tgz (x/<step>.log, off_*.json, summary.txt).
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $X/gpu.txt
step tests 40 130 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_fp8_lm_head.py"
for i in $(seq 1 "${PAIRS:-2}"); do
  step off_lmh$i 70 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --engine-arg fp8_lm_head=true --out $X/off_lmh$i.json"
  step off_head16$i 70 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_head16$i.json"
done
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,64 --input-len 1024 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6"
for a in lmh head16; do E=""; [ $a = lmh ] && E="--engine-arg fp8_lm_head=true"
  step lat_$a 45 90 0 "python3 -m benchmarks.bench_latency $LAT $F8 $E --out $X/lat_$a.json"
  grep -aE "^\| *[0-9]+ " $X/lat_$a.log | head -2 | cut -c1-70 | sed "s/^/$a /"; done
step acc 40 120 0 "python3 -m benchmarks.fp8_accuracy --device cuda --dtype bfloat16"
tr '\r' '\n' < $X/acc.log | grep -ao '{"variant.*}' | cut -c1-230  # (the JSON follows tqdm's \r lines)
step off_bf16 70 120 0 "python3 -m benchmarks.bench_offline $OFF --out $X/off_bf16.json"
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf lmh.tgz x && rm -rf x
