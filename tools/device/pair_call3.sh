# pair call 3 of 3 (nvidia-h200-x2; ~9 min, guarded to end by 570 s): a PCIe-class link emulated on
# the pair (NCCL_P2P_DISABLE=1: NCCL goes through host memory), its bandwidth (bench_comm), the
# fast-path tables for tp2 and pp2 under it, then the flip's payoff: bench_flip_workload (auto,
# pp2, tp2 through the real server, calibrated, --simulate: the simulator's prediction of the same
# runs) over the emulated link, and over NVLink if time is left (else: ONLY=wl_nvl, ~330 s alone).
# step (est. / skipped under MIN s left / killed at MAX s): comm_pcie 30/30/90, lat_tp2_pcie
# 55/50/120, lat_pp2_pcie 50/50/120, off_tp2_pcie 55/50/120, off_pp2_pcie 50/50/120,
# wl_pcie 300/240/420, wl_nvl 300/240/420 (the workload's own --time-budget-s: its limit - 10 s).
# Results: $OUT/pair_call3.tgz (pair_call3_only.tgz under ONLY="a b", which runs only those steps): x/<step>.log, .json, .png, summary.txt.
. tools/device/lib.sh
P=NCCL_P2P_DISABLE=1
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,64,256 --input-len 1024 --output-len 128 --num-iters 1 --num-warmup 1 --max-prefill-tokens 32768"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024 --max-duration-s 90"
step comm_pcie 30 90 3 "$P python3 -m benchmarks.bench_comm --world-size 2 --out $X/comm_pcie.json"
step lat_tp2_pcie 50 120 5 "$P python3 -m benchmarks.bench_latency $LAT --engine-arg tp_size=2 --out $X/lat_tp2_pcie.json"
step lat_pp2_pcie 50 120 5 "$P python3 -m benchmarks.bench_latency $LAT --engine-arg pp_size=2 --out $X/lat_pp2_pcie.json"
step off_tp2_pcie 50 120 2 "$P python3 -m benchmarks.bench_offline $OFF --engine-arg tp_size=2 --out $X/off_tp2_pcie.json"
step off_pp2_pcie 50 120 2 "$P python3 -m benchmarks.bench_offline $OFF --engine-arg pp_size=2 --out $X/off_pp2_pcie.json"
wl pcie 240 auto,pp2,tp2 tp2,pp2 $P
wl nvl 240 auto,pp2,tp2 tp2,pp2
python3 tools/device/summary.py $X comm offline workload | tee $X/summary.txt
cd $OUT && tar czf pair_call3${ONLY:+_only}.tgz x && rm -rf x
