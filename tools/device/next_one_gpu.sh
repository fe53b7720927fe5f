# the next one-GPU call, by the card that came (a call for nvidia-h200 may get an H100): an
# H200 -> lmh_call.sh (the FP8 LM head against the 16-bit one; its 16-bit arm is also the
# H200's FP8 offline figure with the rows padded to 128, the batch longest first and o/down
# folded, and its bf16 run the bf16 one), then head_tune_call.sh, pdl_chain_call.sh and
# silu_call.sh in the calls after; anything else -> head_tune_call.sh (the FP8 LM head's
# W8A8 skinny entries for that card). END, ONLY and PAIRS pass through to the script.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
case "$card" in
  *H200*) exec bash tools/device/lmh_call.sh;;
  *) exec bash tools/device/head_tune_call.sh;;
esac
