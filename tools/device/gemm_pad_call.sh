# any one sm_90 GPU (~8 min with PAIRS=2, guarded to end by END, default 570 s): a large
# GEMM's rows padded for cuBLAS (kernels/gemm_rows.py FP8_ROW_PAD = 128 since 2026-12-06,
# BF16_ROW_PAD off).
# On an H100 (2026-12-06) cuBLAS's row-wise FP8 GEMM of the 8B's gate_up took 1 862 µs at
# 8 705 rows against 1 651 at 8 704 (bf16: 3 192 against 2 798). DTYPE=fp8 (default) or bf16:
#   sweep   benchmarks.scaled_mm_probe --m-sweep [--bf16]: a layer's four GEMMs over row
#           counts and what each padding multiple saves on the odd ones; picks PAD (or PAD=n)
#   tests   the padding's tests (tests/test_gemm_rows.py, the FP8 ones in
#           tests/test_fp8_quant_fusion.py: the real _scaled_mm on NaN-padded rows), compiled
#   off_*   offline in that dtype, pad / nopad (the switch at 0), PAIRS interleaved pairs (if
#           the sweep saves more than 1 %, or PAD=n given). ONLY="off_pad1 off_nopad1 ..."
#           with PAD=128 runs the A/B alone.
# Results: $OUT/gemm_pad_$DTYPE.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
DTYPE=${DTYPE:-fp8}
if [ $DTYPE = bf16 ]; then SW=--bf16; SWITCH=BF16_ROW_PAD; D=""
else SW=""; SWITCH=FP8_ROW_PAD; D="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"; fi
step sweep 90 240 8 "python3 -m benchmarks.scaled_mm_probe --m-sweep $SW --out $X/m_sweep.json"
pad=${PAD:-$(python3 -c "
import json; r = json.load(open('$X/m_sweep.json')); b = r['best_pad']
print(b if r['pads'][str(b)]['saving'] > 0.01 else '')" 2>/dev/null)}
echo "$DTYPE pad to A/B: ${pad:-none}"
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_gemm_rows.py tests/test_fp8_quant_fusion.py"
G=phaseflip/kernels/gemm_rows.py; cp $G /tmp/gemm_rows.py
arm() { cp /tmp/gemm_rows.py $G; local v=0; [ $1 = pad ] && v=$pad
  sed -i "s/^$SWITCH = [0-9]* /$SWITCH = $v /" $G; grep "^$SWITCH" $G; }
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
if [ -n "$pad" ]; then for i in $(seq 1 ${PAIRS:-2}); do for a in pad nopad; do arm $a
  step off_$a$i 70 120 0 "python3 -m benchmarks.bench_offline $OFF $D --out $X/off_$a$i.json"; done; done; fi
cp /tmp/gemm_rows.py $G
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf gemm_pad_$DTYPE.tgz x && rm -rf x
