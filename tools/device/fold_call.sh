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
offline_ab phaseflip/model/quant/fp8.py fold rowwise 's/^FOLD_SCALES = True$/FOLD_SCALES = False/'
step sweep 100 220 6 "python3 -m benchmarks.scaled_mm_probe --m-sweep --tensorwise --out $X/m_sweep_tw.json"
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf fold.tgz x && rm -rf x
