# the next one-GPU call, by card. The GPU test files passed at aac53ad (the tree of 587b082 plus an
# off-by-default prefetch, since reverted) on an H100 (twelfth H100, 2026-12-07: gpu_tests_call.sh, group 3 alone), and the H100's
# FP8 head tile entries shipped (tile_head_call.sh, +0.3 %). On an H200: the offline tail's
# decode profile (decode_mid_call.sh) for the H200's own tail table (~2 min), then
# gpu_tests_call.sh's FP8 and bf16 offline figures for the card (ONLY). On any other card:
# gpu_tests_call.sh (the GPU test files on the tree of the day, FP8 offline once).
# END, ONLY and PAIRS pass through.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) END=250 bash tools/device/decode_mid_call.sh
          END=300 ONLY="${ONLY:-off_fp8 off_bf16}" exec bash tools/device/gpu_tests_call.sh ;;
  *) ONLY="${ONLY:-gtests off_fp8}" exec bash tools/device/gpu_tests_call.sh ;;
esac
