# any sm_90 card (~8 min; guarded to end by END, default 570 s): FP8 o and down run cuBLAS
# tensor-wise and the residual add + RMSNorm applies their scales (model/quant/fp8.py
# FOLD_SCALES, `ScaledRows`; built on the CPU, the H100 probe's row-wise/tensor-wise µs at
# 8 320 rows: down 900/734, o 230/219). Steps: `tests` (the fold's and the FP8 fusion's
# tests on the GPU: the real tensor-wise `_scaled_mm`), then FP8 offline fold against
# row-wise in PAIRS interleaved pairs (default 2), then `sweep` (the tensor-wise GEMMs over
# row counts, for the padding multiple). Results: $OUT/fold.tgz. Run on H100s on 2026-12-06
# (docs/benchmarks.md, eighth H100): padded +0.2 % (noise), unpadded +0.4 % in both pairs
# (16 844 / 16 833 against 16 766 / 16 774); shipped unpadded.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
T="python3 -m pytest -q -p no:cacheprovider"
step tests 40 150 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_fp8_scaled_rows.py tests/test_fp8_quant_fusion.py"
Q=phaseflip/model/quant/fp8.py; cp $Q /tmp/fp8.py
arm() { cp /tmp/fp8.py $Q; [ $1 = rowwise ] && sed -i 's/^FOLD_SCALES = True$/FOLD_SCALES = False/' $Q
  grep -c "^FOLD_SCALES = True" $Q; }
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
for i in $(seq 1 ${PAIRS:-2}); do for a in fold rowwise; do arm $a
  step off_$a$i 40 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
cp /tmp/fp8.py $Q
step sweep 100 220 6 "python3 -m benchmarks.scaled_mm_probe --m-sweep --tensorwise --out $X/m_sweep_tw.json"
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf fold.tgz x && rm -rf x
