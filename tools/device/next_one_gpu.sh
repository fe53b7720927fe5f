# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100): an
# H200 -> defaults_ab_call.sh (row padding, longest first and the o/down fold, on against
# off: lmh_call.sh and head_tune_call.sh ran there on 2026-12-06), then tile_head_call.sh,
# pdl_chain_call.sh and silu_call.sh in the calls after; anything else -> tile_head_call.sh
# (the FP8 LM head's tile-GEMM entries for that card: its W8A8 skinny entries, head_tune_call.sh,
# ran on an H100 on 2026-12-07 and ship). END, ONLY and PAIRS pass through.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) exec bash tools/device/defaults_ab_call.sh;;
  *) exec bash tools/device/tile_head_call.sh;;
esac
