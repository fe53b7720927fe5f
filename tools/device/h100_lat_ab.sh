# one H100 (~4 min): FP8 decode latency at batch 1 / 16 / 64, shipped tables against the
# candidate skinny + tile tables in .carry/h100_new (skinny_h100.json, tile_new.json, as
# h100_call2.sh writes them), two interleaved pairs. Ship the candidates only if they win.
# Results: $OUT/h100_lat_ab.tgz: x/lat_{shipped,new}{1,2}.json and logs.
. tools/device/lib.sh
read S T < <(python3 -c "
import torch; from phaseflip.kernels.tile_gemm import table_path
from phaseflip.kernels.linear_configs import skinny_table_path
n = torch.cuda.get_device_name(0); print(skinny_table_path(n), table_path(n))")
cp $S /tmp/skinny_old.json; cp $T /tmp/tile_old.json
arm() { case $1 in shipped) cp /tmp/skinny_old.json $S; cp /tmp/tile_old.json $T;;
  new) cp .carry/h100_new/skinny_h100.json $S; cp .carry/h100_new/tile_new.json $T;; esac; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,16,64 --input-len 1024 --output-len 128 --num-iters 1 --num-warmup 1"
for i in 1 2; do for a in shipped new; do arm $a
  step lat_$a$i 40 80 4 "python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a$i.json"; done; done
arm shipped
cd $OUT && tar czf h100_lat_ab.tgz x && rm -rf x
