# any one sm_90 GPU (~6 min with PAIRS=1, guarded to end by END, default 570 s): the tile GEMM (129-1 024
# rows) launched with PDL, its first weight tile prefetched before its wait.
#   tests   tests/test_pdl.py (the decode-layer chain in a graph at 16 and 256 sequences)
#   red     the graph tests with SiLU·mul's wait removed: must fail
#   lat_*   bench_latency FP8 at 160/256/512 sequences of 256 prompt tokens, tile
#           (tile_gemm.PDL_LAUNCH = True) / shipped, PAIRS interleaved pairs (default 1)
#   off_*   FP8 offline, tile / shipped, PAIRS interleaved pairs
# (2026-12-06, H100: tests passed, red failed as it must; the latency runs of 512 x 512
# prompt tokens ran out of memory in their one prefill step, hence 256 tokens now.)
# Results: $OUT/pdl_tile.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
pdl_checks
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 160,256,512 --input-len 256 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
G=phaseflip/kernels/tile_gemm.py; cp $G /tmp/tile_gemm.py
arm() { cp /tmp/tile_gemm.py $G; [ $1 = tile ] && sed -i 's/^PDL_LAUNCH = False/PDL_LAUNCH = True/' $G; }
for i in $(seq 1 ${PAIRS:-1}); do for a in tile shipped; do arm $a
  step lat_$a$i 50 100 0 "python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a$i.json"
  grep -aE "^\| *[0-9]+ " $X/lat_$a$i.log | head -3 | cut -c1-75 | sed "s/^/$a$i /"; done; done
for i in $(seq 1 ${PAIRS:-1}); do for a in tile shipped; do arm $a
  step off_$a$i 70 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf pdl_tile.tgz x && rm -rf x
