# any one sm_90 GPU (~6 min, guarded to end by END, default 570 s): the FP8 decode tail's
# attention launches swept (Triton launch shapes x split counts, the CUDA kernel and its
# gather-only build at every split count; benchmarks/fp8_decode_probe.py --tail-sweep), after
# the compiled checks and the split probe that tail_call.sh runs (ONLY narrows the steps).
# Results: $OUT/x/<step>.log, tail_sweep.json, probe_split.json.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv | tee $X/gpu.txt
GK="tests/test_linear_kernel.py tests/test_triton_attention.py tests/test_attention_cuda.py tests/test_tile_gemm.py"
step gk 40 100 6 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider $GK -k 'split or w8a8 or extend or window or diagonal or cuda_graph or routes or and_triton'"
step tail 60 300 0 "python3 -m benchmarks.fp8_decode_probe --tail-sweep --out $X/tail_sweep.json"
grep -a "^B=" $X/tail.log
step probe_split 30 80 0 "python3 -m benchmarks.fp8_decode_probe --split-only --out $X/probe_split.json"
grep -aE "^B=|^  \(" $X/probe_split.log
