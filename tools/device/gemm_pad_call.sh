# any one sm_90 GPU (~8 min with PAIRS=2, guarded to end by END, default 570 s): the FP8
# GEMM's rows padded (kernels/fp8_quant.py GEMM_ROW_PAD, off). On an H100 (2026-12-06) cuBLAS's
# row-wise FP8 GEMM of the 8B's gate_up took 1 862 µs at 8 705 rows against 1 651 at 8 704.
#   sweep   benchmarks.scaled_mm_probe --m-sweep: a layer's four GEMMs over row counts and
#           what each padding multiple saves on the odd ones; picks PAD (or PAD=n given)
#   tests   the padding's CPU-interpreted tests, and the FP8 tests, compiled
#   off_*   FP8 offline, pad / shipped, PAIRS interleaved pairs (if the sweep saves > 1 %)
# Results: $OUT/gemm_pad.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
step sweep 90 200 8 "python3 -m benchmarks.scaled_mm_probe --m-sweep --out $X/m_sweep.json"
pad=${PAD:-$(python3 -c "
import json; r = json.load(open('$X/m_sweep.json')); b = r['best_pad']
print(b if r['pads'][str(b)]['saving'] > 0.01 else '')" 2>/dev/null)}
echo "pad to A/B: ${pad:-none}"
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_fp8_quant_fusion.py tests/test_fp8_weights.py"
Q=phaseflip/kernels/fp8_quant.py; cp $Q /tmp/fp8_quant.py
arm() { cp /tmp/fp8_quant.py $Q; [ $1 = pad ] && sed -i "s/^GEMM_ROW_PAD = 0$/GEMM_ROW_PAD = $pad/" $Q; true; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
if [ -n "$pad" ]; then for i in $(seq 1 ${PAIRS:-2}); do for a in pad shipped; do arm $a
  step off_$a$i 70 110 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done; fi
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf gemm_pad.tgz x && rm -rf x
