# pair call 1 of 3 (nvidia-h200-x2, NCCL one rank per GPU; ~8.5 min, guarded to end by 570 s):
# the NVLink link, live-flip seams tp2 <-> pp2 on Llama-3.1-8B dummy weights (peer forced; the
# planner's choice over 50 flips under load with the accounting checked every step; reload
# forced), the NCCL correctness tests, and tests/test_flip.py's strategy tests moved to CUDA.
# step (est. / skipped under MIN s left / killed at MAX s): comm_nvl 30/30/90, flip_peer 50/60/150,
# flip_auto50 70/80/200, tests_nccl 180/150/260, flip_reload 45/60/150, tests_flip_cuda 120/90/200.
# Results: $OUT/pair_call1.tgz (pair_call1_only.tgz under ONLY="a b", which runs only those steps): x/<step>.log, .json, .png, summary.txt.
. tools/device/lib.sh
seams() { python3 tools/device/summary.py $X flips | tee $X/summary.txt; }
M="--model llama-3.1-8b --load-format dummy --mem-fraction 0.5"
FL="$M --layouts tp2,pp2,tp2,pp2,tp2 --num-prompts 32 --dataset fixed --input-len 256 --output-len 64 --flip-every 6"
L50=$(printf 'tp2,pp2,%.0s' {1..25})tp2
step comm_nvl 30 90 3 "python3 -m benchmarks.bench_comm --world-size 2 --out $X/comm_nvl.json"
step flip_peer 60 150 2 "python3 -m benchmarks.bench_flip $FL --engine-arg flip_weights=peer --out $X/flip_peer.json $(pl flip_peer)"
step flip_auto50 80 200 2 "python3 -m benchmarks.bench_flip $M --layouts $L50 --num-prompts 32 --dataset fixed --input-len 256 --output-len 260 --flip-every 4 --engine-arg check_accounting=true --out $X/flip_auto50.json $(pl flip_auto50)"
step tests_nccl 150 260 8 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -rs --durations=5 tests/test_multi_gpu.py tests/test_gpu.py::test_resident_flips_over_nccl_replay_parked_graphs tests/test_symm_allreduce.py::test_symm_mem_equals_nccl_one_rank_per_gpu -k 'not server'"
step flip_reload 60 150 2 "python3 -m benchmarks.bench_flip $FL --engine-arg flip_weights=reload --out $X/flip_reload.json"
step tests_flip_cuda 90 200 8 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --durations=5 tests/test_flip.py -k 'each_weights_strategy or kv_pressure or three_flip_cycles or fp8_slices'"
seams
cd $OUT && tar czf pair_call1${ONLY:+_only}.tgz x && rm -rf x
