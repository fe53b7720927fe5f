# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# H200 -> h200_fp8_call.sh without its `ranks` step (forked ranks passed on CUDA on
# 2026-12-05), to be followed by h200_fp8_call2.sh; H100 -> h100_call2.sh; anything else ->
# gpu_tests_call.sh. END and ONLY pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) ONLY=${ONLY:-"lk_clamp lk_mask tune off_clamp1 off_mask1 off_tuned1 off_clamp2 off_mask2 off_tuned2 bf16"} \
            exec bash tools/device/h200_fp8_call.sh;;
  *H100*) exec bash tools/device/h100_call2.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
