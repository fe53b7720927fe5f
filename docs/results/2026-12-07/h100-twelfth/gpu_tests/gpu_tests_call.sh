# any one GPU (~9 min, guarded to end by 570 s): the GPU test files in four pytest processes
# sharing the card (the refactors of the skinny GEMM's launch, the worker's build and the
# forked ranks had run only on the CPU), then FP8 and bf16 offline once each (the same
# 1 000-request command as docs/benchmarks.md) as an end-to-end check and a figure for the card.
# On an H100 (2026-12-05) groups 1-4 took 244 / 103 / >350 / 218 s; the multi-rank sampling
# tests moved from group 3 to group 2 since. tests/test_profile_mixed_step.py (CPU only) left
# group 4 after its 60 s timeout fired under the four processes' CPU load (2026-12-06).
# step (est. / skipped under MIN s left / killed at MAX s): gtests 330/200/360, acc_fold and
# acc_rowwise ~40/30/100 each, off_fp8 80/70/120, off_bf16 80/70/120 (usually skipped).
# Results: $OUT/gpu_tests_call.tgz: x/gt_<group>.txt, acc_*.log, off_*.json, summary.txt.
. tools/device/lib.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $X/gpu.txt
export G1="tests/test_linear_kernel.py tests/test_linear_fold.py tests/test_rotary_fold.py"
export G2="tests/test_tile_gemm.py tests/test_lm_head_buckets.py tests/test_fp8_quant_fusion.py tests/test_fp8_scaled_rows.py tests/test_fp8_quant_kernel.py tests/test_fp8_kv.py tests/test_pp_last_stage_sampling.py"
export G3="tests/test_gpu.py tests/test_cuda_graph.py tests/test_piecewise_graph.py tests/test_pp_async.py tests/test_teardown.py"
export G4="tests/test_attention_cuda.py tests/test_triton_attention.py tests/test_fused_kernels.py tests/test_rope.py tests/test_rope_kv_store.py tests/test_sampling_kernel.py tests/test_hicache_gpu.py tests/test_pdl.py tests/test_gpu_busy.py tests/test_gpu_gaps.py tests/test_symm_allreduce.py"
export X PHASEFLIP_TEST_DEVICE=cuda
step gtests 200 360 0 'for g in 1 2 3 4; do v=G$g; timeout $((STEP_S - 10)) python3 -m pytest -q -p no:cacheprovider ${!v} > $X/gt_$g.txt 2>&1 & done; wait'
unset PHASEFLIP_TEST_DEVICE
for g in 1 2 3 4; do echo "group $g: $(tail -1 $X/gt_$g.txt)"; grep -aE '^(FAILED|ERROR)' $X/gt_$g.txt | head -8; done
# FP8 accuracy on the GPU against a bf16 engine (docs/quantization.md has only CPU figures),
# with o/down folded (the default) and row-wise (FOLD_SCALES off): what the fold's extra bf16
# rounding costs where cuBLAS runs the prompt rows
Q=phaseflip/model/quant/fp8.py; cp $Q /tmp/fp8.py
step acc_fold 30 100 0 "python3 -m benchmarks.fp8_accuracy --device cuda --dtype bfloat16"
sed -i 's/^FOLD_SCALES = True$/FOLD_SCALES = False/' $Q; cmp -s /tmp/fp8.py $Q && echo "!! FOLD_SCALES unchanged"
step acc_rowwise 30 100 0 "python3 -m benchmarks.fp8_accuracy --device cuda --dtype bfloat16"
cp /tmp/fp8.py $Q
for a in fold rowwise; do tr '\r' '\n' < $X/acc_$a.log | grep -ao '{"variant.*}' | cut -c1-220 | sed "s/^/$a /"; done
F8="--engine-arg quantization=fp8 --engine-arg kv_cache_dtype=fp8_e4m3"
OFF="--model llama-3.1-8b --load-format dummy --num-prompts 1000 --dataset sharegpt-like --seed 0 --mem-fraction 0.85 --max-running-requests 1024"
step off_fp8 70 120 0 "python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_fp8.json"
step off_bf16 70 120 0 "python3 -m benchmarks.bench_offline $OFF --out $X/off_bf16.json"
python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf gpu_tests_call.tgz x && rm -rf x
