# one H200 (nvidia-h200; ~8 min, guarded to end by 570 s): the skinny kernel's masked x rows
# (landed, measured only in isolation under one config) against the clamp it replaced, under
# the shipped per-bucket configs; the tile table's 48-128-row buckets re-tuned against the
# masked kernel; FP8 offline A/B, interleaved: clamp + the old table (what ran before),
# mask + the old table, mask + the re-tuned table; then bf16 offline once if time is left.
# Needs .carry/linear_clamp.py: `git show 81dcf82:phaseflip/kernels/linear.py > .carry/linear_clamp.py`.
# step (est. / skipped under MIN s left / killed at MAX s): ranks 60/30/120, lk_clamp 40/30/120, lk_mask
# 40/30/120, tune 40/30/150, off_{clamp,mask,tuned}{1,2} 55/60/110 each, bf16 55/60/110.
# Results: $OUT/h200_fp8_call.tgz: x/<step>.log, lk_*.json, tile_small.json, off_*.json, summary.txt.
. tools/device/lib.sh
L=phaseflip/kernels/linear.py T=phaseflip/assets/kernel_configs/tile_gemm_nvidia_h200.json
S=phaseflip/assets/kernel_configs/skinny_linear_nvidia_h200.json
cp $L /tmp/linear_mask.py; cp $T /tmp/table_old.json
arm() { case $1 in clamp) cp .carry/linear_clamp.py $L; cp /tmp/table_old.json $T;;
  mask) cp /tmp/linear_mask.py $L; cp /tmp/table_old.json $T;;
  tuned) cp /tmp/linear_mask.py $L; cp /tmp/table_new.json $T;; esac; }
LK="--fp8-weights --w8a8 --tuned-json $S --m 16,24,32,48,64,80,96,112,128 --shapes llama.qkv,llama.o,llama.gate_up,llama.down --no-eager --no-model-pass"
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
# ranks forked from the torch-preloaded forkserver (spawner.py, not yet run on a GPU): tp2, pp2
# and tp2xpp2 sharing the GPU against one process; if this fails, PHASEFLIP_SPAWN_RANKS=1
step ranks 30 120 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k 'layouts or live_flips' tests/test_pp_last_stage_sampling.py"
arm clamp; step lk_clamp 30 120 0 "python3 -m benchmarks.linear_kernels $LK --out $X/lk_clamp.json"
arm mask; step lk_mask 30 120 0 "python3 -m benchmarks.linear_kernels $LK --out $X/lk_mask.json"
step tune 30 150 30 "python3 -m benchmarks.tile_gemm_tune --dtype fp8 --shapes llama.qkv llama.o llama.gate_up llama.down --m 48,64,80,96,112,128 --table $X/tile_small.json --out $X/tune.json"
python3 - $X/tile_small.json <<'PY'  # the old table, its FP8 rows of <= 128 rows replaced by the re-tune's
import json, sys, shutil
try:
    new = json.load(open(sys.argv[1]))
except Exception:
    shutil.copy("/tmp/table_old.json", "/tmp/table_new.json"); sys.exit(print("no re-tune: the tuned arm runs the old table"))
old = json.load(open("/tmp/table_old.json"))
key = lambda r: (r["m_bucket"], r["n"], r["k"], r["dtype"])
rows = {key(r): r for r in old if not (r["m_bucket"] <= 128 and r["dtype"] == "float8_e4m3fn")}
rows.update({key(r): r for r in new})
json.dump([rows[k] for k in sorted(rows)], open("/tmp/table_new.json", "w"), indent=1)
print("re-tuned rows:", len(new), "with a tile config:", sum(1 for r in new if r.get("config")))
PY
cp /tmp/table_new.json $X/tile_table_new.json
for i in 1 2; do for a in clamp mask tuned; do
  arm $a; step off_$a$i 60 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
arm tuned; step bf16 60 110 0 "python3 -m benchmarks.bench_offline $OFF --out $X/off_bf16.json"
python3 tools/device/summary.py $X fp8 offline | tee $X/summary.txt
cp /tmp/linear_mask.py $L; cp /tmp/table_old.json $T
cd $OUT && tar czf h200_fp8_call.tgz x && rm -rf x
