# any one sm_90 GPU (~9 min, guarded to end by END, default 570 s): the decode chain's
# kernels between GEMMs launched with PDL (kernels/pdl.py, chain_launch_options).
#   tests   tests/test_pdl.py (the 8B-shaped decode-layer chain in a graph against the same
#           kernels serialised, and one layer of it against torch)
#   red     the graph test with SiLU·mul's wait removed: must fail (a read before the wait)
#   lat_*   bench_latency batch 1/16/64, chain (default) / gemms (PHASEFLIP_PDL_GEMMS_ONLY=1),
#           interleaved: FP8 two pairs, bf16 one
#   off_*   offline, interleaved: FP8 two pairs, bf16 one
# Results: $OUT/pdl_chain.tgz (x/<step>.log, lat_*.json, off_*.json, summary.txt).
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $X/gpu.txt
pdl_checks
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,16,64 --input-len 1024 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
ab() {  # ab KIND(lat|off) DTYPE(fp8|bf16) PAIR MIN MAX
  local a E F=""; [ $2 = fp8 ] && F="$F8"
  for a in chain gemms; do E=""; [ $a = gemms ] && E="PHASEFLIP_PDL_GEMMS_ONLY=1"
    if [ $1 = lat ]; then
      step lat_$2_$a$3 $4 $5 0 "$E python3 -m benchmarks.bench_latency $LAT $F --out $X/lat_$2_$a$3.json"
      grep -aE "^\| *[0-9]+ " $X/lat_$2_$a$3.log | head -3 | cut -c1-60 | sed "s/^/$2 $a$3 /"
    else
      step off_$2_$a$3 $4 $5 0 "$E python3 -m benchmarks.bench_offline $OFF $F --out $X/off_$2_$a$3.json"
    fi; done; }
ab lat fp8 1 50 90; ab lat fp8 2 50 90
ab off fp8 1 70 110; ab off fp8 2 70 110
ab lat bf16 1 50 90; ab off bf16 1 70 110
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf pdl_chain.tgz x && rm -rf x
