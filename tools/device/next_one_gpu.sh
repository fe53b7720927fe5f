# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# any sm_90 card -> lof_call.sh (Engine.generate's batch longest output first against the
# workload's order, FP8 offline pairs; measured on the CPU only) unless SKIP_LOF=1 (each script
# is a whole call: lof_call.sh ends it); with SKIP_LOF=1, on an H200, pdl_chain_call.sh (the decode chain's PDL against the skinny-GEMM-only scope,
# measured on H100s only; it also gives the H200's current FP8 and bf16 offline figures, with
# the FP8 rows padded to 128 and the batch longest first) and silu_call.sh; anything else ->
# gpu_tests_call.sh. END, ONLY and PAIRS pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H100*|*H200*) [ "$SKIP_LOF" = 1 ] || PAIRS=${PAIRS:-2} exec bash tools/device/lof_call.sh;;&
  *H200*) exec bash tools/device/pdl_chain_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
