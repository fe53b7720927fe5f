# one H100 (~9 min, guarded to end by END, default 570 s): the skinny GEMM's table for this
# card (only its W8A8 16-64-row rows ship, tail_call.sh of 2026-12-05; the rest of its
# decode GEMMs of 1-128 rows run the heuristic configs). Tunes the FP8
# Llama-3.1-8B projections and LM head at 1-16 rows with bf16 x (W8A16), the projections at
# 16-128 rows with FP8 x (W8A8), then re-tunes the tile table's 48-128-row buckets against the
# tuned skinny kernel; then FP8 batch-1/64 latency and FP8 offline, A/B interleaved:
# shipped (no skinny table) / tuned (skinny table + re-tuned tile rows).
# Ship x/skinny_h100.json and x/tile_new.json under phaseflip/assets/kernel_configs/ with
# this card's name only if the tuned arm wins.
# step (est. / skipped under MIN s left / killed at MAX s): tune_w8a16 100/60/150,
# tune_w8a8 120/60/170, tile 40/30/80, lat_{shipped,tuned} 40/40/70, off_{shipped,tuned}{1,2}
# 50/55/90. Results: $OUT/h100_call2.tgz: x/<step>.log, *.tuned.json, lat_*.json, off_*.json.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/gpu.txt
read S T < <(python3 -c "
import torch; from phaseflip.kernels.tile_gemm import table_path
from phaseflip.kernels.linear_configs import skinny_table_path
n = torch.cuda.get_device_name(0); print(skinny_table_path(n), table_path(n))")
cp $T /tmp/tile_old.json
TJ=""; [ -f $S ] && { cp $S /tmp/skinny_old.json; TJ="--tuned-json $S"; }  # W8A8 16-64 ships
LK="--fp8-weights --no-eager --no-model-pass --shapes llama.qkv,llama.o,llama.gate_up,llama.down"
step tune_w8a16 60 150 12 "python3 -m benchmarks.linear_kernels $LK,llama.lm_head $TJ --tune --m 1,2,4,8,16 --out $X/sk_w8a16.json"
[ -s $X/sk_w8a16.tuned.json ] && step tune_w8a8 60 170 12 "python3 -m benchmarks.linear_kernels $LK --w8a8 --tuned-json $X/sk_w8a16.tuned.json --tune --m 16,32,64,128 --out $X/sk_w8a8.json"
for f in sk_w8a8 sk_w8a16; do [ -s $X/$f.tuned.json ] && { cp $X/$f.tuned.json $X/skinny_h100.json; break; }; done
[ -s $X/skinny_h100.json ] || { echo "no skinny table: nothing to A/B"; cd $OUT && tar czf h100_call2.tgz x; exit 0; }
cp $X/skinny_h100.json $S; cp /tmp/tile_old.json $X/tile_new.json
step tile 30 80 20 "python3 -m benchmarks.tile_gemm_tune --dtype fp8 --shapes llama.qkv llama.o llama.gate_up llama.down --m 48,64,80,96,112,128 --table $X/tile_new.json --out $X/tile_small.json"
restore() { if [ -n "$TJ" ]; then cp /tmp/skinny_old.json $S; else rm -f $S; fi; }
arm() { case $1 in shipped) restore; cp /tmp/tile_old.json $T;; tuned) cp $X/skinny_h100.json $S; cp $X/tile_new.json $T;; esac; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,64 --input-len 1024 --output-len 128 --num-iters 1 --num-warmup 1"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for a in shipped tuned; do arm $a; step lat_$a 40 70 4 "python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a.json"; done
for i in 1 2; do for a in shipped tuned; do
  arm $a; step off_$a$i 55 90 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf h100_call2.tgz x && rm -rf x
