# The front end's event loop and HTTP parser on a GPU server (FP8 Llama-3.1-8B shape, dummy
# weights, 256 concurrent completions streams of 512 tokens, a chunk per delta): uvloop +
# httptools (the dependencies, as installed) against asyncio's loop + h11 (PHASEFLIP_EVENT_LOOP
# =asyncio and httptools moved out of the path), interleaved in PAIRS pairs.
. tools/device/lib.sh
SERVE="--model llama-3.1-8b --load-format dummy --device cuda --quantization fp8 --kv-cache-dtype fp8_e4m3 --mem-fraction 0.85"
for i in $(seq 1 "${PAIRS:-2}"); do for arm in fast plain; do
  if [ $arm = plain ]; then mv /tmp/site/httptools /tmp/httptools_off; export PHASEFLIP_EVENT_LOOP=asyncio; fi
  step fe_$arm$i 60 170 0 "python3 -m benchmarks.front_end_cost --endpoint ${ENDPOINT:-completions} --concurrency 256 --output-len 512 --rounds 1 --serve-args '$SERVE' --out $X/fe_$arm$i.json"
  python3 -c "import json; r=json.load(open('$X/fe_$arm$i.json')); print('$arm$i', {k: r[k] for k in ('tokens','chunks','wall_s','tokens_per_s','front_end_us_per_token','front_end_us_per_chunk','engine_us_per_token')})" 2>/dev/null || tail -5 $X/fe_$arm$i.log
  if [ $arm = plain ]; then mv /tmp/httptools_off /tmp/site/httptools; unset PHASEFLIP_EVENT_LOOP; fi
done; done
tar czf $OUT/front_end_loop_call.tgz -C $OUT x
