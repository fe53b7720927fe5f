# quad call 1 (nvidia-h200-x4, NCCL one rank per GPU; ~9 min, guarded to end by 570 s): the
# tp2xpp2 NCCL tests; bandwidth (4 ranks); live flips among tp4, pp4 and tp2xpp2 (all six
# directions) for Llama-3.1-8B and a Llama-3.1-70B-shaped model (bundled as llama-3.1-70b:
# 80 layers, hidden 8192), dummy weights, the planner's choice (8B: resident,
# 70B: peer); then the workload (auto, pp4, tp4; --simulate) over an emulated PCIe-class link.
# step (est. / skipped under MIN s left / killed at MAX s): tests_quad 60/60/200, comm_nvl
# 25/25/90, flip_8b 60/60/150, flip_70b 150/100/260, wl_pcie 300/200/420 (its --time-budget-s:
# what is left - 10 s; it skips or cuts the runs that do not fit), then if time is left comm_pcie
# 20/20/90, flip_8b_peer 60/60/150, wl_nvl 300/200/420; the rest in a second call with ONLY=...
# Results: $OUT/quad_call1.tgz (quad_call1_only.tgz under ONLY="a b", which runs only those steps): x/<step>.log, .json, .png, summary.txt.
. tools/device/lib.sh
P=NCCL_P2P_DISABLE=1
Q="--load-format dummy --layouts tp4,pp4,tp2xpp2,tp4,tp2xpp2,pp4,tp4 --num-prompts 32 --dataset fixed --input-len 256 --output-len 64 --flip-every 6"
step tests_quad 60 200 6 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --durations=3 tests/test_multi_gpu.py -k 2-2"
step comm_nvl 25 90 4 "python3 -m benchmarks.bench_comm --world-size 4 --sizes 8K,2M,128M,1G --out $X/comm_nvl.json"
step flip_8b 60 150 2 "python3 -m benchmarks.bench_flip --model llama-3.1-8b $Q --mem-fraction 0.5 --out $X/flip_8b.json $(pl flip_8b)"
step flip_70b 100 260 2 "python3 -m benchmarks.bench_flip --model llama-3.1-70b $Q --mem-fraction 0.8 --out $X/flip_70b.json $(pl flip_70b)"
wl pcie 200 auto,pp4,tp4 tp4,pp4 $P
step comm_pcie 20 90 4 "$P python3 -m benchmarks.bench_comm --world-size 4 --sizes 8K,2M,128M,1G --out $X/comm_pcie.json"
step flip_8b_peer 60 150 2 "python3 -m benchmarks.bench_flip --model llama-3.1-8b $Q --mem-fraction 0.5 --engine-arg flip_weights=peer --out $X/flip_8b_peer.json"
wl nvl 200 auto,pp4,tp4 tp4,pp4
python3 tools/device/summary.py $X flips comm workload | tee $X/summary.txt
cd $OUT && tar czf quad_call1${ONLY:+_only}.tgz x && rm -rf x
