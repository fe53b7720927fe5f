# The front end's frozen heap on a GPU server: bench_serving through a launched server (FP8
# Llama-3.1-8B shape, dummy weights, 256 concurrent streams of 512 tokens, 768 requests),
# the heap frozen (the tree as it is) and not (`collector_watched` disabled by sed),
# interleaved in PAIRS pairs: output tokens/s, TTFT and inter-chunk gaps (p50/p99/max).
. tools/device/lib.sh
SERVE="--model llama-3.1-8b --load-format dummy --device cuda --quantization fp8 --kv-cache-dtype fp8_e4m3 --mem-fraction 0.85 --max-running-requests 256"
L=phaseflip/server/launch.py; cp $L /tmp/launch_orig
for i in $(seq 1 "${PAIRS:-1}"); do for arm in frozen unfrozen; do cp /tmp/launch_orig $L
  if [ $arm = unfrozen ]; then sed -i 's/^        with ctx.metrics.collector_watched():.*$/        if True:/' $L; cmp -s /tmp/launch_orig $L && echo "!! the sed changed nothing"; fi
  step sv_$arm$i 60 240 0 "python3 -m benchmarks.bench_serving --launch --serve-args '$SERVE' --max-concurrency 256 --num-prompts 768 --dataset fixed --input-len 128 --output-len 512 --out $X/sv_$arm$i.json"
  python3 -c "import json; r=json.load(open('$X/sv_$arm$i.json')); print('$arm$i', r['completed'], 'of', r['num_prompts'], 'tok/s', round(r['output_tokens_per_s']), 'ttft p50/p99', [round(1e3*r['ttft_s'][k],1) for k in ('p50','p99')], 'itl ms p50/p99/max', [round(1e3*r['itl_s'][k],1) for k in ('p50','p99','max')])" 2>/dev/null || tail -5 $X/sv_$arm$i.log
done; done
cp /tmp/launch_orig $L
gzip -f $X/sv_*.json
tar czf $OUT/front_end_gc_call.tgz -C $OUT x
