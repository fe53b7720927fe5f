# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# any sm_90 card -> gemm_pad_call.sh (the FP8 GEMM's rows padded: sweep, then an offline
# A/B) unless SKIP_PAD=1; then, on an H200, pdl_chain_call.sh (the decode chain's PDL against
# the skinny-GEMM-only scope, measured on H100s only; it also gives the H200's current FP8
# and bf16 offline figures) and silu_call.sh; anything else -> gpu_tests_call.sh. END, ONLY,
# PAIRS and PAD pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H100*|*H200*) [ "$SKIP_PAD" = 1 ] || exec bash tools/device/gemm_pad_call.sh;;&
  *H200*) exec bash tools/device/pdl_chain_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
