# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# first `gk`, the compiled check of the kernels changed since the last GPU run (the skinny
# kernel's split arrival, the extend kernel's key range: 1fd0908; the CUDA FP8 decode
# kernel's split plans; ~100 s) and `probe_split` (~40 s), then
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
export END=$((END - SECONDS))
case "$card" in
  *H200*) ONLY=${ONLY:-"lk_mask tune off_mask1 off_tuned1 off_mask2 off_tuned2 bf16"} \
            exec bash tools/device/h200_fp8_call.sh;;
  *H100*) exec bash tools/device/h100_call2.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
