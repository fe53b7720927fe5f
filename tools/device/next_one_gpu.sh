# the next one-GPU call, whatever the card: gpu_tests_call.sh (the GPU test files at the tree,
# then FP8 and bf16 offline once each). Since the last GPU test run (2026-12-06) the loader
# checks every checkpoint tensor's shape (a tied checkpoint's head rows sampled on the device),
# HiCache's page identity took the quantization and compute dtype, and the offline Engine's
# generate holds Ctrl-C between steps: none of it has run on a GPU. (The seventeenth H200 run,
# 2026-12-07, ran the queue before it: defaults_ab, tile_head, pdl_chain, silu.)
# END, ONLY and PAIRS pass through.
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "card: $card"
exec bash tools/device/gpu_tests_call.sh
