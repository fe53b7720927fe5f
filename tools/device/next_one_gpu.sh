# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# an H200 -> pdl_chain_call.sh (the decode chain's PDL against the skinny-GEMM-only scope:
# measured on H100s on 2026-12-06, not yet on an H200; it also gives the H200's current FP8
# and bf16 offline figures), then silu_call.sh in the next call; anything else ->
# gpu_tests_call.sh (the H100's pending A/Bs ran on 2026-12-06, sixth H100). END, ONLY and
# PAIRS pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) exec bash tools/device/pdl_chain_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
