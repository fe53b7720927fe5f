# any one sm_90 GPU (~6 min, guarded to end by END, default 570 s): the FP8 LM head
# (--fp8-lm-head) at 48-1 024 rows (an offline run's decode batches) runs cuBLAS: no tile-GEMM
# entry for its shape (128 256 x 4 096).
#   tune     benchmarks.tile_gemm_tune --dtype fp8 --shapes llama.lm_head, merged into a copy
#            of the shipped table (x/tile_new.json)
#   off_*    FP8 + --fp8-lm-head offline, new table / shipped, PAIRS interleaved pairs
#            (default 2)
# Ship x/tile_new.json as phaseflip/assets/kernel_configs/tile_gemm_<card>.json only if the
# new arm wins. Results: $OUT/tile_head.tgz.
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
T=$(python3 -c "import torch; from phaseflip.kernels.tile_gemm import table_path; print(table_path(torch.cuda.get_device_name(0)))")
cp $T /tmp/tile_shipped.json
step tune 60 240 40 "python3 -m benchmarks.tile_gemm_tune --dtype fp8 --shapes llama.lm_head --table auto --out $X/tune.json"
cp $T $X/tile_new.json; cp /tmp/tile_shipped.json $T
arm() { case $1 in new) cp $X/tile_new.json $T;; shipped) cp /tmp/tile_shipped.json $T;; esac; }
if ! cmp -s $X/tile_new.json /tmp/tile_shipped.json; then
  for i in $(seq 1 "${PAIRS:-2}"); do for a in new shipped; do arm $a
    step off_$a$i 60 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --engine-arg fp8_lm_head=true --out $X/off_$a$i.json"; done; done
else echo "no head entry beat cuBLAS: nothing to A/B"; fi
arm shipped
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf tile_head.tgz x && rm -rf x
