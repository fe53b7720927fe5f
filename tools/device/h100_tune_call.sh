# one H100 (~7 min, guarded to end by END, default 570 s): the FP8 tile-GEMM table for this
# card, which ships none (the H200's table is keyed by its name). Tunes the Llama-3.1-8B
# projections at every bucket from 48 to 1 024 rows against cuBLAS and the skinny kernel's
# heuristic configs, then FP8 offline A/B, interleaved: no table (what ships) / the tuned one.
# Ship x/tile_h100.json as phaseflip/assets/kernel_configs/tile_gemm_<gpu name>.json (the
# name in gpu.txt, lower case, spaces and dashes as underscores) only if the tuned arm wins.
# step (est. / skipped under MIN s left / killed at MAX s): tune 200/120/220,
# off_{none,tuned}{1,2} 55/60/100 each. Results: $OUT/h100_tune_call.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/gpu.txt
T=$(python3 -c "import torch; from phaseflip.kernels.tile_gemm import table_path; print(table_path(torch.cuda.get_device_name(0)))")
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
step tune 120 220 40 "python3 -m benchmarks.tile_gemm_tune --dtype fp8 --shapes llama.qkv llama.o llama.gate_up llama.down --table $X/tile_h100.json --out $X/tune.json"
arm() { case $1 in none) rm -f $T;; tuned) cp $X/tile_h100.json $T;; esac; }
if [ -s $X/tile_h100.json ]; then for i in 1 2; do for a in none tuned; do
  arm $a; step off_$a$i 60 100 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done; fi
rm -f $T
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf h100_tune_call.tgz x && rm -rf x
