# The front end's cost per token on a GPU server (FP8 Llama-3.1-8B shape, dummy weights, 256
# concurrent streams of 512 tokens, ENDPOINT chat or completions): the stream join on (the tree as it is) and off (its
# loop disabled by sed), interleaved in PAIRS pairs. `python -m benchmarks.front_end_cost`.
. tools/device/lib.sh
SERVE="--model llama-3.1-8b --load-format dummy --device cuda --quantization fp8 --kv-cache-dtype fp8_e4m3 --mem-fraction 0.85"
J=phaseflip/server/engine_client.py; cp $J /tmp/ec_orig
for i in $(seq 1 "${PAIRS:-2}"); do for arm in join nojoin; do cp /tmp/ec_orig $J
  if [ $arm = nojoin ]; then sed -i 's/^                while carry is None and not q.empty():$/                while False:/' $J; cmp -s /tmp/ec_orig $J && echo "!! the sed changed nothing"; fi
  step fe_$arm$i 60 170 0 "python3 -m benchmarks.front_end_cost --endpoint ${ENDPOINT:-chat} --concurrency 256 --output-len 512 --rounds 1 --serve-args '$SERVE' --out $X/fe_$arm$i.json"
  python3 -c "import json; r=json.load(open('$X/fe_$arm$i.json')); print('$arm$i', {k: r[k] for k in ('tokens','chunks','wall_s','tokens_per_s','front_end_us_per_token','engine_us_per_token')})" 2>/dev/null || tail -5 $X/fe_$arm$i.log
done; done
cp /tmp/ec_orig $J
tar czf $OUT/front_end_call.tgz -C $OUT x
