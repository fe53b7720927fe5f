# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100):
# an H200 or H100 -> tail_call.sh (the kernels changed since the last GPU run checked
# compiled, the CUDA split decode probed, the skinny W8A8 buckets re-tuned, FP8 offline A/B);
# anything else -> gpu_tests_call.sh. Afterwards, on an H100: h100_call2.sh. Both cards'
# W8A8 16-64-row buckets are re-tuned with the wide split candidates (H100 2026-12-05, H200
# 2026-12-06, whose 48-128-row tile buckets were re-tuned against the masked kernel the same
# day), so both run gk and probe_split only unless ONLY says otherwise. END and ONLY pass
# through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) ONLY=${ONLY:-"gk probe_split"} exec bash tools/device/tail_call.sh;;
  *H100*) ONLY=${ONLY:-"gk probe_split"} exec bash tools/device/tail_call.sh;;
  *) exec bash tools/device/gpu_tests_call.sh;;
esac
