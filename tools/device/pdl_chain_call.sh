# any one sm_90 GPU (~9.5 min, guarded to end by END, default 570 s): the decode chain's
# kernels between GEMMs launched with PDL (kernels/pdl.py, chain_launch_options).
#   tests   tests/test_pdl.py (the 8B-shaped decode-layer chain in a graph against the same
#           kernels serialised), then the same chain test with SiLU·mul's wait removed
#           (must fail: a read before the wait), then the attention / rotary / linear checks
#   lat_*   bench_latency FP8 batch 1/16/64, chain (default) / gemms (PHASEFLIP_PDL_GEMMS_ONLY=1),
#           interleaved pairs
#   off_*   FP8 offline, one interleaved pair
# Results: $OUT/x/<step>.log, lat_*.json, off_*.json.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $X/gpu.txt
T="python3 -m pytest -q -p no:cacheprovider"
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py"
cp phaseflip/kernels/activation.py /tmp/act.py
sed -i 's/^    wait_previous(PDL)$/    pass  # wait removed/' phaseflip/kernels/activation.py
step red 30 100 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py -k decode_layer_chain"
cp /tmp/act.py phaseflip/kernels/activation.py
GK="tests/test_triton_attention.py tests/test_rope_kv_store.py tests/test_linear_kernel.py tests/test_tile_gemm.py tests/test_fp8_kv.py"
step gk 60 130 4 "PHASEFLIP_TEST_DEVICE=cuda $T $GK -k 'split or w8a8 or decode or cuda_graph or store or tile'"
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,16,64 --input-len 1024 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6"
for i in 1 2; do for a in chain gemms; do E=""; [ $a = gemms ] && E="PHASEFLIP_PDL_GEMMS_ONLY=1"
  step lat_$a$i 50 90 0 "$E python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a$i.json"
  grep -aE "^\| *[0-9]+ " $X/lat_$a$i.log | head -3 | sed "s/^/$a$i /"; done; done
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for a in chain gemms; do E=""; [ $a = gemms ] && E="PHASEFLIP_PDL_GEMMS_ONLY=1"
  step off_$a 70 110 0 "$E python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a.json"; done
python3 tools/device/summary.py $X offline | tee $X/summary.txt
