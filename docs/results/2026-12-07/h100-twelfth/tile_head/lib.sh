# Sourced first by every device call here (`. tools/device/lib.sh` from the repo root): the
# server's wheels from .carry/whl (the device has no FastAPI, pydantic, pyzmq ...), the NVLink
# multicast switches off, $X for results, and `step`, which runs one measurement inside the
# call's deadline (and `offline_ab`, an FP8 offline A/B of a one-line switch). Each script
# copies itself and this file into its results.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PWD || exit
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
END=${END:-570}; X=$OUT/x; mkdir -p $X; cp "$0" tools/device/lib.sh $X/
{ nvidia-smi topo -m; nvidia-smi --query-gpu=name,memory.total --format=csv; df -h /dev/shm /tmp; free -g; } > $X/topo.txt 2>&1
# step NAME MIN_S MAX_S LINES 'command': skipped (ONLY="a b" names the steps to run) or when
# fewer than MIN_S seconds are left of END; killed at MAX_S or END - 15 s (then the GPU's
# leftover processes too); its log in x/NAME.log, its last LINES key lines printed
step() {
  local name=$1 min=$2 max=$3 left=$((END - SECONDS)) t0=$SECONDS rc
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && return
  [ $left -lt $min ] && { echo "== $name SKIPPED: $left s left, needs $min"; return; }
  local t=$((max < left - 15 ? max : left - 15))
  STEP_S=$t timeout -k 10 $t bash -c "$5" > $X/$name.log 2>&1; rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s (limit $t s)"
  [ $rc -ge 124 ] && nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
  tr '\r' '\n' < $X/$name.log | grep -aE '^\||passed|failed|FAILED|skipped|Error|error:|^wrote /|^run |: (ok|MISSED)$' | grep -v '^|-' | tail -n $4
}
# --plot PATH when matplotlib imports (the device may lack it)
pl() { python3 -c "import matplotlib" 2>/dev/null && echo "--plot $X/$1.png"; }
# the flip's payoff through the real server: wl NAME MIN_S RUNS FLIP_LAYOUTS [ENV=VALUE]
# (bench_flip_workload, calibrated, --simulate; its own --time-budget-s: its limit - 10 s)
WL_SERVE="--model llama-3.1-8b --load-format dummy --device cuda --dtype bfloat16 --enable-hicache --hicache-host-gb 16 --mem-fraction 0.85 --page-size 16 --max-running-requests 128 --chunked-prefill-size 8192 --max-prefill-tokens 8192 --dist-timeout-s 120 --shutdown-timeout 5"
WL_ARGS="--duration-s 30 --alternate --burst-every-s 6 --burst-requests 32 --burst-prefix-tokens 4096 --burst-suffix-tokens 4096 --burst-output-tokens 32 --background-rps 2 --background-prompt-tokens 256 --background-output-tokens 128 --calib-bursts 8 --calib-background 12 --calib-max-new-tokens 16 --calib-timeout-s 150 --launch-estimate-s 60 --reserve-s 25"
wl() { step wl_$1 $2 420 16 "$5 python3 -m benchmarks.bench_flip_workload --runs $3 --flip-layouts $4 --serve-args '$WL_SERVE' $WL_ARGS --time-budget-s \$((STEP_S - 10)) --out $X/wl_$1.json $(pl wl_$1)"; }
# the PDL chain's GPU tests (steps `tests`, then `red`: the graph test with SiLU·mul's
# `wait_previous` removed, which must fail), for the pdl_*_call.sh scripts
pdl_checks() {
  local T="python3 -m pytest -q -p no:cacheprovider" A=phaseflip/kernels/activation.py
  step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py"
  cp $A /tmp/act.py; sed -i 's/^    wait_previous(PDL)$/    pass  # wait removed/' $A
  step red 30 100 6 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py -k chain_in_a_graph"
  cp /tmp/act.py $A
}
# the offline workload of docs/benchmarks.md ("Where the engine stands") and the FP8 switches
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
# offline_ab FILE ARM_ON ARM_OFF 'SED': FP8 offline in PAIRS interleaved pairs (default 2),
# steps off_<arm><i>: ARM_ON runs the tree as it is, ARM_OFF with SED applied to FILE (a
# missed pattern is printed: that arm would run the tree as is); FILE is restored after
offline_ab() {
  local f=$1 on=$2 off=$3 i a; cp "$f" /tmp/ab_orig
  for i in $(seq 1 "${PAIRS:-2}"); do for a in "$on" "$off"; do cp /tmp/ab_orig "$f"
    if [ "$a" = "$off" ]; then sed -i "$4" "$f"; cmp -s /tmp/ab_orig "$f" && echo "!! $a: '$4' changed nothing in $f"; fi
    step "off_$a$i" 40 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"
  done; done
  cp /tmp/ab_orig "$f"
}
