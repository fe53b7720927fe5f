# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100): an
# H200 -> pdl_chain_call.sh (the decode chain's PDL against the skinny-GEMM-only scope,
# measured on H100s only; it also gives the H200's current FP8 and bf16 offline figures, with
# the FP8 rows padded to 128, the batch longest first and o/down folded), then silu_call.sh
# in the call after; anything else -> gpu_tests_call.sh (the GPU test groups, last run on an
# H100 before the fold). END, ONLY and PAIRS pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) exec bash tools/device/pdl_chain_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
