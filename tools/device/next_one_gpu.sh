# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# an H200 -> pdl_chain_call.sh (the decode chain's PDL against the skinny-GEMM-only scope:
# measured on H100s on 2026-12-06, not yet on an H200), then pdl_tile_call.sh in the next
# call; an H100 -> pdl_tile_call.sh (the tile GEMM launched with PDL, off until measured);
# anything else -> gpu_tests_call.sh. Then silu_call.sh (the FP8 SiLU·mul variants) on either
# sm_90 card. END, ONLY and PAIRS pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) exec bash tools/device/pdl_chain_call.sh;;
  *H100*) exec bash tools/device/pdl_tile_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
