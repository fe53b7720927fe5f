# the next one-GPU call, by card. The GPU test files passed at 1729b19 on an H100 (eleventh H100,
# 2026-12-07: gpu_tests_call.sh, group 3 alone), and the offline tail's FP8 decode steps were
# profiled there (decode_mid_call.sh). On an H200: the same profile for the H200's own tail
# table (~2 min), then gpu_tests_call.sh's FP8 and bf16 offline figures for the card (ONLY).
# On any other card: tile_head_call.sh (the FP8 head's tile-GEMM entries for that card).
# END, ONLY and PAIRS pass through.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) END=250 bash tools/device/decode_mid_call.sh
          END=300 ONLY="${ONLY:-off_fp8 off_bf16}" exec bash tools/device/gpu_tests_call.sh ;;
  *) exec bash tools/device/tile_head_call.sh ;;
esac
