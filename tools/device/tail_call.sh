# any one sm_90 GPU (~9 min, guarded to end by END, default 570 s): the FP8 decode tail.
#   gk           compiled checks of the kernels changed since the last GPU run (the skinny
#                kernel's split arrival and the extend kernel's key range, 1fd0908; the CUDA
#                FP8 decode kernel's split plans, 3c85f34; the tile GEMM's split arrival
#                through the shared `linear_workspace.split_arrive`)
#   probe_split  that CUDA kernel against Triton's on the tail's split shapes
#   tune_sk      the skinny GEMM's W8A8 16/32/64-row buckets re-tuned with the wider split
#                candidates (1,2,3,4,6,8,auto,2x auto), against the card's shipped
#                table (the output is the whole table with those buckets replaced)
#   off_*        FP8 offline, interleaved pairs: shipped / new, where new = the re-tuned table
#                + the CUDA kernel for split plans where the probe found it faster
# step (est. / skipped under MIN s left / killed at MAX s): gk 80/40/100, probe_split 40/30/80,
# tune_sk 200/120/300, off_{shipped,new}{1,2} 55/60/110.
# Results: $OUT/tail_call.tgz: x/<step>.log, probe_split.json, lk_tune*.json, off_*.json.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $X/gpu.txt
S=$(python3 -c "import torch; from phaseflip.kernels.linear_configs import skinny_table_path
print(skinny_table_path(torch.cuda.get_device_name(0)))")
A=phaseflip/kernels/attention_cuda.py; cp $A /tmp/attention_cuda.py
TJ=""; [ -f $S ] && { cp $S /tmp/skinny_old.json; TJ="--tuned-json $S"; }
GK="tests/test_linear_kernel.py tests/test_triton_attention.py tests/test_attention_cuda.py tests/test_tile_gemm.py"
step gk 40 100 6 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider $GK -k 'split or w8a8 or extend or window or diagonal or cuda_graph or routes or and_triton'"
step probe_split 30 80 8 "python3 -m benchmarks.fp8_decode_probe --split-only --out $X/probe_split.json"
grep -aE "^B=|^  \(" $X/probe_split.log
faster=$(python3 -c "import json; c=json.load(open('$X/probe_split.json'))['cases']; print(int(max(r['err_cuda'] for r in c) < 1e-2 and sum(r['cuda_us'] for r in c) < sum(r['triton_us'] for r in c)))" 2>/dev/null)
echo "CUDA split decode faster and correct: ${faster:-unknown}"
LK="--fp8-weights --w8a8 --m 16,32,64 --shapes llama.qkv,llama.o,llama.gate_up,llama.down --no-eager --no-model-pass"
step tune_sk 120 300 30 "python3 -m benchmarks.linear_kernels $LK $TJ --tune --out $X/lk_tune.json"
[ -s $X/lk_tune.tuned.json ] || [ "$faster" = 1 ] || { echo "nothing new to A/B"; cd $OUT && tar czf tail_call.tgz x; exit 0; }
arm() { cp /tmp/attention_cuda.py $A; if [ -n "$TJ" ]; then cp /tmp/skinny_old.json $S; else rm -f $S; fi
  if [ $1 = new ]; then [ -s $X/lk_tune.tuned.json ] && cp $X/lk_tune.tuned.json $S
    [ "$faster" = 1 ] && sed -i 's/^SPLIT_PLANS = False/SPLIT_PLANS = True/' $A; fi; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for i in 1 2; do for a in shipped new; do
  arm $a; step off_$a$i 60 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf tail_call.tgz x && rm -rf x
