#!/usr/bin/env bash
# Folded (the default) vs unfolded (PHASEFLIP_NO_FOLD=1) decode layers, the same bench_latency command, runs
# interleaved on one machine: ./benchmarks/fold_ab.sh OUT_DIR PAIRS DTYPE(fp8|bf16) [BATCHES]
set -uo pipefail
out=$1; pairs=$2; dtype=$3; batches=${4:-1,2,16}
flags=()
if [ "$dtype" = fp8 ]; then
  flags=(--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3)
fi
for i in $(seq 1 "$pairs"); do
  for mode in fold nofold; do
    env_flag=(PHASEFLIP_NO_FOLD=1); [ "$mode" = fold ] && env_flag=(PHASEFLIP_NO_FOLD=0)
    env "${env_flag[@]}" python3 -m benchmarks.bench_latency --model llama-3.1-8b \
      --load-format dummy --batch-sizes "$batches" --input-len 1024 --output-len 32 \
      --num-iters 1 --num-warmup 1 --mem-fraction 0.6 "${flags[@]}" \
      --out "$out/lat_${dtype}_${mode}_$i.json" > "$out/lat_${dtype}_${mode}_$i.txt" 2>&1
    grep -E "^\| *[0-9]+ " "$out/lat_${dtype}_${mode}_$i.txt" | head -5 | sed "s/^/$mode $i /"
  done
done
