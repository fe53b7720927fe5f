# pair call 2 of 3 (nvidia-h200-x2, NCCL; ~8.5 min, guarded to end by 570 s): live-flip seams
# tp2 <-> pp2 with a real random Llama-3.1-8B checkpoint (host-image and reload forced; peer and
# resident at the end if time is left), then the fast path over NVLink: bench_latency and
# bench_offline (1000 ShareGPT-like) for tp2, pp2 and one GPU, each GPU's NVML busy.
# step (est. / skipped under MIN s left / killed at MAX s): comm_nvl 15/20/60, ckpt 30/30/150,
# flip_host-image_real 60/70/150, flip_reload_real 55/70/150, lat_tp2 50/50/120, lat_pp2 50/50/120,
# tp1 (latency on GPU 0 beside offline on GPU 1) 60/60/150, off_tp2 50/50/120, off_pp2 50/50/120,
# flip_peer_real 50/60/120, flip_resident_real 50/60/120, tests_server (the two NCCL server tests
# of tests/test_multi_gpu.py, left out of call 1) 90/90/150.
# Results: $OUT/pair_call2.tgz (pair_call2_only.tgz under ONLY="a b", which runs only those steps): x/<step>.log, .json, .png, summary.txt.
. tools/device/lib.sh
# the checkpoint drawn on the GPU (seconds; on the CPU's one thread a minute or more for 8B);
# tmpfs when it holds it and the host image
CK=/dev/shm/ck8b; [ "$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)" -ge 48 ] || CK=/tmp/ck8b
R="--model $CK --mem-fraction 0.5 --layouts tp2,pp2,tp2,pp2,tp2 --num-prompts 32 --dataset fixed --input-len 256 --output-len 64 --flip-every 6"
LAT="--model llama-3.1-8b --load-format dummy --batch-sizes 1,64,256 --input-len 1024 --output-len 128 --num-iters 1 --num-warmup 1 --max-prefill-tokens 32768"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024 --max-duration-s 90"
flip() { step flip_$1_real $2 $3 1 "python3 -m benchmarks.bench_flip $R --engine-arg flip_weights=$1 --out $X/flip_$1_real.json $(pl flip_$1_real)"; }
step comm_nvl 20 60 2 "python3 -m benchmarks.bench_comm --world-size 2 --sizes 128M,1G --iters 10 --out $X/comm_nvl.json"
step ckpt 30 150 2 "python3 tools/make_random_checkpoint.py --model llama-3.1-8b --out $CK --device cuda && du -sh $CK"
flip host-image 70 150
flip reload 70 150
step lat_tp2 50 120 5 "python3 -m benchmarks.bench_latency $LAT --engine-arg tp_size=2 --out $X/lat_tp2.json"
step lat_pp2 50 120 5 "python3 -m benchmarks.bench_latency $LAT --engine-arg pp_size=2 --out $X/lat_pp2.json"
step tp1 60 150 8 "CUDA_VISIBLE_DEVICES=0 python3 -m benchmarks.bench_latency $LAT --out $X/lat_tp1.json > $X/lat_tp1.log 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 -m benchmarks.bench_offline $OFF --out $X/off_tp1.json; wait; cat $X/lat_tp1.log"
step off_tp2 50 120 2 "python3 -m benchmarks.bench_offline $OFF --engine-arg tp_size=2 --out $X/off_tp2.json"
step off_pp2 50 120 2 "python3 -m benchmarks.bench_offline $OFF --engine-arg pp_size=2 --out $X/off_pp2.json"
flip peer 60 120
flip resident 60 120
step tests_server 90 150 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider --durations=2 tests/test_multi_gpu.py -k server"
python3 tools/device/summary.py $X flips offline | tee $X/summary.txt
rm -rf $CK  # the machine may stay warm for call 3: free its tmpfs
cd $OUT && tar czf pair_call2${ONLY:+_only}.tgz x && rm -rf x
