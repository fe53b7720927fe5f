# one GPU (~5 min, guarded to end by END, default 570 s): why the H100 host idles the GPU.
# The H100 runs of 2026-12-05 idled the GPU 5-22 % in FP8 offline (NVML busy 78-95 %,
# 0.8-4.1 ms a step, varying run to run) where the H200 runs idled ~0.4 %. Records the
# host's CPU facts (model, cgroup quota and throttling, CPU pressure) around two profiled
# FP8 offline runs (`profile_offline --host-clock --gpu-clock`: each step's host phases and
# the GPU's idle time before it, by step kind and batch size) and samples `top` meanwhile.
# step (est. / skipped under MIN s left / killed at MAX s): prof1, prof2 90/70/150.
# Results: $OUT/h100_host_call.tgz: x/<step>.log, prof*.json, host_*.txt, top_*.txt.
. tools/device/lib.sh
facts() {  # the host's CPU state now, into $X/host_$1.txt
  { date; nproc; uptime; grep -m1 "model name" /proc/cpuinfo; grep MHz /proc/cpuinfo | sort | uniq -c | head
    for f in /sys/fs/cgroup/cpu.max /sys/fs/cgroup/cpu.stat /proc/pressure/cpu /sys/fs/cgroup/cpu.pressure; do
      echo "== $f"; cat $f 2>&1; done
    python3 -c "import time
for _ in range(5):
    t = time.perf_counter(); sum(range(10**7)); print('sum(range(1e7)) s', round(time.perf_counter() - t, 3))"
  } > $X/host_$1.txt 2>&1; }
facts before
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for i in 1 2; do
  (top -b -d 1 -n 150 -w 200 > $X/top_$i.txt 2>&1) & T=$!
  step prof$i 70 150 30 "python3 -m benchmarks.profile_offline $OFF $F8 --host-clock --gpu-clock --out $X/prof$i.json"
  kill $T 2>/dev/null; facts after$i
done
cd $OUT && tar czf h100_host_call.tgz x && rm -rf x
