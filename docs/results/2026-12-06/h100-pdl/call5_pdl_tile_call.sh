# any one sm_90 GPU (~4 min, guarded to end by END, default 570 s): the tile GEMM (129-1 024
# rows) launched with PDL, its first weight tile prefetched before its wait.
#   tests   tests/test_pdl.py (the decode-layer chain in a graph at 16 and 256 sequences)
#   red     the graph tests with SiLU·mul's wait removed: must fail
#   lat_*   bench_latency FP8 at 160/256/512 sequences, chain (default) / gemms
#           (PHASEFLIP_PDL_GEMMS_ONLY=1), PAIRS interleaved pairs (default 1)
# Results: $OUT/pdl_tile.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
T="python3 -m pytest -q -p no:cacheprovider"
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py"
cp phaseflip/kernels/activation.py /tmp/act.py
sed -i 's/^    wait_previous(PDL)$/    pass  # wait removed/' phaseflip/kernels/activation.py
step red 30 100 6 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py -k chain_in_a_graph"
cp /tmp/act.py phaseflip/kernels/activation.py
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 160,256,512 --input-len 512 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6"
for i in $(seq 1 ${PAIRS:-1}); do for a in chain gemms; do E=""; [ $a = gemms ] && E="PHASEFLIP_PDL_GEMMS_ONLY=1"
  step lat_$a$i 50 100 0 "$E python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a$i.json"
  grep -aE "^\| *[0-9]+ " $X/lat_$a$i.log | head -3 | cut -c1-75 | sed "s/^/$a$i /"; done; done
cd $OUT && tar czf pdl_tile.tgz x && rm -rf x
