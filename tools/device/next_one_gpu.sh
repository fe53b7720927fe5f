# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# first `gk`, the compiled check of the kernels changed since the last GPU run (the skinny
# kernel's split arrival, the extend kernel's key range: 1fd0908; the CUDA FP8 decode
# kernel's split plans; ~100 s) and `probe_split` (~40 s), where it wins an FP8 offline pair
# without / with it (~120 s), then
# H200 -> h200_fp8_call.sh without its `ranks` step (forked ranks passed on CUDA on
# 2026-12-05) and without its clamp arm (`lk_clamp`, `off_clamp*`: the clamp was timed in
# isolation on 2026-12-04; the question now is the re-tuned table), to be followed by
# h200_fp8_call2.sh; H100 -> h100_call2.sh; anything else -> gpu_tests_call.sh.
# END and ONLY pass through to the script (its END less the time gk took).
. tools/device/lib.sh
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
GK="tests/test_linear_kernel.py tests/test_triton_attention.py tests/test_attention_cuda.py"
step gk 40 120 6 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider $GK -k 'split or w8a8 or gpu_real or extend or window or diagonal or mixed or cuda_graph or routes or and_triton'"
# the CUDA FP8 decode kernel's split plans (off in the backend until measured): Triton / CUDA
# on the decode tail's shapes, as the backend plans them
step probe_split 30 90 8 "python3 -m benchmarks.fp8_decode_probe --split-only --out $X/probe_split.json"
# where the probe says the CUDA kernel is faster on the split cases (sum of µs), one FP8
# offline pair: Triton for split plans (as shipped) / the CUDA kernel for them
faster=$(python3 -c "import json; c=json.load(open('$X/probe_split.json'))['cases']; print(int(sum(r['cuda_us'] for r in c) < sum(r['triton_us'] for r in c)))" 2>/dev/null)
if [ "$faster" = 1 ]; then
  A=phaseflip/kernels/attention_cuda.py; cp $A /tmp/attention_cuda.py
  F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
  OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
  step off_tri_splits 60 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_tri_splits.json"
  sed -i 's/^SPLIT_PLANS = False/SPLIT_PLANS = True/' $A
  step off_cuda_splits 60 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_cuda_splits.json"
  cp /tmp/attention_cuda.py $A
fi
export END=$((END - SECONDS))
case "$card" in
  *H200*) ONLY=${ONLY:-"lk_mask tune off_mask1 off_tuned1 off_mask2 off_tuned2 bf16"} \
            exec bash tools/device/h200_fp8_call.sh;;
  *H100*) exec bash tools/device/h100_call2.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
