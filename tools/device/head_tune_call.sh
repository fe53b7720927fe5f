# any one sm_90 GPU (~8 min, guarded to end by END, default 570 s): the FP8 LM head's skinny
# GEMM (--fp8-lm-head: 128 256 x 4 096, x quantized per token) has no tuned W8A8 entry in
# the shipped tables, so 3-16 rows run the heuristic's config and 17-128 rows cuBLAS.
#   tune     benchmarks.linear_kernels --fp8-weights --w8a8 --tune on the head's shape at
#            M 4..128 (the shipped table loaded), skinny against per-token quantization +
#            _scaled_mm per M
#   table    x/skinny_new.json = the shipped table + the tuned head entries at M <= 16 and
#            at the larger buckets where the skinny kernel beat cuBLAS by >= 5 %
#   lat_*    FP8 + --fp8-lm-head bench_latency batch 1, 16, 64: new table, shipped, new
#   off_*    FP8 + --fp8-lm-head offline, new / shipped (one pair), if time is left
# Ship x/skinny_new.json as phaseflip/assets/kernel_configs/skinny_linear_<card>.json only
# if the new arms win. Results: $OUT/head_tune.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
S=$(python3 -c "import torch; from phaseflip.kernels.linear_configs import skinny_table_path as p; print(p(torch.cuda.get_device_name(0)))")
cp $S /tmp/skinny_shipped.json
step tune 60 260 14 "python3 -m benchmarks.linear_kernels --shapes llama.lm_head --fp8-weights --w8a8 --tuned-json /tmp/skinny_shipped.json --tune --m 4,8,16,32,64,128 --no-model-pass --no-eager --out $X/head.json"
python3 - "$X" <<'PY' | tee $X/table.txt
import json, sys
from pathlib import Path
x = Path(sys.argv[1]); res = json.loads((x / "head.json").read_text())
win = {r["m"]: r["speedup"] for r in res["rows"]}
keep = {m for m, s in win.items() if m <= 16 or s >= 1.05}
shipped = json.loads(Path("/tmp/skinny_shipped.json").read_text())
head = [e for e in res["tuned_table"] if (e["n"], e["k"], e["dtype"]) == (128256, 4096, "float8_e4m3fn+a8")
        and e["m_bucket"] in keep]
print("skinny/cuBLAS speedup by M:", win, "-> entries kept at M", sorted(keep))
(x / "skinny_new.json").write_text(json.dumps(shipped + head, indent=1))
PY
arm() { case $1 in new) cp $X/skinny_new.json $S;; shipped) cp /tmp/skinny_shipped.json $S;; esac; }
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,16,64 --input-len 1024 --output-len 32 --num-iters 1 --num-warmup 1 --mem-fraction 0.6 --engine-arg fp8_lm_head=true"
if [ -s $X/skinny_new.json ]; then
  for a in new1 shipped new2; do arm ${a%[0-9]}
    step lat_$a 50 100 0 "python3 -m benchmarks.bench_latency $LAT $F8 --out $X/lat_$a.json"
    grep -aE "^\| *[0-9]+ " $X/lat_$a.log | head -3 | cut -c1-70 | sed "s/^/$a /"; done
  for a in new shipped; do arm $a
    step off_$a 80 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --engine-arg fp8_lm_head=true --out $X/off_$a.json"; done
fi
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf head_tune.tgz x && rm -rf x
