# any one sm_90 GPU (~7 min, guarded to end by END, default 570 s): the FP8 SiLU·mul's
# variants (kernels/activation.py FAST_SILU_FP8, off; SCRATCH_SLOTS_FP8, 528 since 2026-12-06).
#   tests    tests/test_fp8_quant_fusion.py compiled (the scratch-slot rows bitwise, the fast
#            SiLU within a step)
#   micro    benchmarks.fused_kernels --silu-variants (T 800 and 8192 x 28672)
#   off_*    FP8 offline, shipped / the fastest variant at T 8192 (if it beats the shipped
#            kernel by more than 3 %; VARIANT="FAST SLOTS" names one instead), PAIRS
#            interleaved pairs (default 2)
# (2026-12-06, H100, sixth H100 in docs/benchmarks.md: 528 slots 277 against 326 µs at
# T 8192; offline unchanged over three pairs (VARIANT="0 528" PAIRS=3 ONLY="off_new1 ...");
# 528 slots shipped. The "shipped" arm is now the tree's, slots on.)
# Results: $OUT/silu.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_fp8_quant_fusion.py"
step micro 30 120 20 "python3 -m benchmarks.fused_kernels --silu-variants --out $X/silu_variants.json"
pick=${VARIANT:-$(python3 -c "
import json; r = [x for x in json.load(open('$X/silu_variants.json'))['rows'] if x['tokens'] == 8192]
base = next(x for x in r if x['shipped']); best = min(r, key=lambda x: x['us'])
print(f\"{int(best['fast'])} {best['slots']}\" if best['us'] < 0.97 * base['us'] else '')" 2>/dev/null)}
echo "variant to A/B (fast slots): ${pick:-none}"
A=phaseflip/kernels/activation.py; cp $A /tmp/activation.py
arm() { cp /tmp/activation.py $A; [ $1 = new ] || return 0; set -- $pick
  [ "$1" = 1 ] && sed -i 's/^FAST_SILU_FP8 = False/FAST_SILU_FP8 = True/' $A
  sed -i "s/^SCRATCH_SLOTS_FP8 = [0-9]*$/SCRATCH_SLOTS_FP8 = $2/" $A; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
if [ -n "$pick" ]; then for i in $(seq 1 ${PAIRS:-2}); do for a in new shipped; do arm $a
  step off_$a$i 70 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done; fi
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf silu.tgz x && rm -rf x
