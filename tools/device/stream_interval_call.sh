# `--stream-interval` on a GPU server (FP8 Llama-3.1-8B shape, dummy weights, 256 concurrent
# completions streams of 512 tokens): N = 1 (the default) against N = 4 (INTERVAL), interleaved
# in PAIRS pairs. `python -m benchmarks.front_end_cost`: tokens/s, chunks, front-end and engine
# CPU a token.
. tools/device/lib.sh
SERVE="--model llama-3.1-8b --load-format dummy --device cuda --quantization fp8 --kv-cache-dtype fp8_e4m3 --mem-fraction 0.85"
for i in $(seq 1 "${PAIRS:-1}"); do for n in 1 ${INTERVAL:-4}; do
  step si_$n.$i 60 170 0 "python3 -m benchmarks.front_end_cost --endpoint completions --concurrency 256 --output-len 512 --rounds 1 --serve-args '$SERVE --stream-interval $n' --out $X/si_$n.$i.json"
  python3 -c "import json; r=json.load(open('$X/si_$n.$i.json')); print('N=$n ($i)', {k: r[k] for k in ('tokens','chunks','wall_s','tokens_per_s','front_end_us_per_token','engine_us_per_token')})" 2>/dev/null || tail -5 $X/si_$n.$i.log
done; done
tar czf $OUT/stream_interval_call.tgz -C $OUT x
