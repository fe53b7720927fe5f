# any one GPU (~5 min; guarded to end by END, default 570 s): the FP8 defaults measured on H100s
# only, together, on or off: GEMM rows padded to 128 (kernels/gemm_rows.py FP8_ROW_PAD, +0.7 %
# seventh H100), the offline batch longest output first (engine/engine.py, +0.8 %) and o/down
# tensor-wise with their scales folded (model/quant/fp8.py FOLD_SCALES, +0.4 %; both eighth
# H100). FP8 offline, PAIRS interleaved pairs (default 2): off_on<i> = the tree, off_off<i> =
# all three off (each sed checked: a pattern that changes nothing is printed).
# Results: $OUT/defaults_ab.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
FILES="phaseflip/kernels/gemm_rows.py phaseflip/engine/engine.py phaseflip/model/quant/fp8.py"
for f in $FILES; do cp $f /tmp/$(basename $f).orig; done
off() {
  sed -i 's/^FP8_ROW_PAD = 128 /FP8_ROW_PAD = 0 /' phaseflip/kernels/gemm_rows.py
  sed -i 's/for i in longest_output_first(\[p.max_new_tokens for p in params\]):/for i in range(len(params)):/' phaseflip/engine/engine.py
  sed -i 's/^FOLD_SCALES = True/FOLD_SCALES = False/' phaseflip/model/quant/fp8.py
  for f in $FILES; do cmp -s /tmp/$(basename $f).orig $f && echo "!! off: nothing changed in $f"; done
}
restore() { for f in $FILES; do cp /tmp/$(basename $f).orig $f; done; }
for i in $(seq 1 "${PAIRS:-2}"); do for a in on off; do restore; [ $a = off ] && off
  step off_$a$i 40 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$a$i.json"; done; done
restore
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf defaults_ab.tgz x && rm -rf x
