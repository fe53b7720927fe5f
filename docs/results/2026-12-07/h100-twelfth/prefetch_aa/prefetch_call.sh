# any one sm_90 GPU (~7 min, guarded to end by END, default 570 s): the decode tail's L2
# prefetch of the o projection's weight (`kernels.attention.PREFETCH_MODE`, new 2026-12-07).
# The tail's split decode reads K/V at 1.3-1.9 of the H100's 3.35 TB/s (eleventh H100); its
# programs now may pull o_proj's 16.8 MB (FP8) into L2 for the GEMM after them.
#   tests        the prefetch's GPU tests (bitwise equal outputs, eager and graphed), the
#                attention and PDL test files with the prefetch on
#   p<B>_<L>_<m> profile_decode FP8, batch B, input L, PHASEFLIP_ATTN_PREFETCH=m (off / on /
#                first), modes interleaved; pb16_<m> the same in bf16
#   off_<m><i>   FP8 offline (docs/benchmarks.md's 1 000 requests) per mode of OFF_MODES, PAIRS
#                interleaved rounds; none unless OFF_MODES is set (a second call: ONLY=
#                "off_off1 off_first1 off_off2 off_first2" OFF_MODES="off first" ...)
# Results: $OUT/prefetch.tgz (x/*.json, x/*.log).
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
T="python3 -m pytest -q -p no:cacheprovider"
step tests 40 150 6 "PHASEFLIP_TEST_DEVICE=cuda PHASEFLIP_ATTN_PREFETCH=first $T tests/test_attention_prefetch.py tests/test_triton_attention.py tests/test_pdl.py"
P="python3 -m benchmarks.profile_decode --model llama-3.1-8b --load-format dummy --steps 16 --top 12 --gaps 20 --mem-fraction 0.6"
for bl in ${SHAPES:-16_1536 64_1024 1_1024}; do b=${bl%_*}; l=${bl#*_}
  for m in ${MODES:-off on first}; do
    step p${bl}_$m 30 90 0 "PHASEFLIP_ATTN_PREFETCH=$m $P $F8 --batch-size $b --input-len $l --out $X/p${bl}_$m.json"
    echo "p${bl}_$m: $(grep -aoE 'wall [0-9.]+ ms/step' $X/p${bl}_$m.log) $(grep -aE '_decode_split_kernel|_skinny_kernel' $X/p${bl}_$m.log | tr -s ' ' | tr '\n' ' ')"
  done
done
for m in ${BF16_MODES:-off first}; do
  step pb16_$m 30 90 0 "PHASEFLIP_ATTN_PREFETCH=$m $P --batch-size 16 --input-len 1536 --out $X/pb16_$m.json"
  echo "pb16_$m: $(grep -aoE 'wall [0-9.]+ ms/step' $X/pb16_$m.log)"
done
# FP8 offline, OFF_MODES interleaved PAIRS times (none unless OFF_MODES is set)
for i in $(seq 1 "${PAIRS:-2}"); do for m in ${OFF_MODES:-}; do
  step off_$m$i 40 120 0 "PHASEFLIP_ATTN_PREFETCH=$m python3 -m benchmarks.bench_offline $OFF $F8 --out $X/off_$m$i.json"
done; done
[ -n "${OFF_MODES:-}" ] && python3 tools/device/summary.py $X offline | tee $X/summary.txt
cd $OUT && tar czf prefetch.tgz x && rm -rf x
