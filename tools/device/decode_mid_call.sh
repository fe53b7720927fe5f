# any one sm_90 GPU (~5 min, guarded to end by END, default 570 s): where an FP8 decode step of
# the offline run's tail goes (16-112 sequences of ~1-1.5 k keys: ~500 steps at ~5.4-5.7 ms,
# against ~2 ms to stream the FP8 weights and ~1 ms of K/V). No profile of these batch sizes
# had been taken since the masked skinny kernel, the tile tables and PDL on the chain.
#   p<B>_<L>  profile_decode FP8, batch B, input L, 16 steps, top 40 kernels, gaps >= 20 us
#   pb64      the same for bf16 at batch 64 (the bf16 offline target's tail)
# Results: $OUT/decode_mid.tgz (x/p*.json, x/p*.log).
. tools/device/lib.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee $X/gpu.txt
P="python3 -m benchmarks.profile_decode --model llama-3.1-8b --load-format dummy --steps 16 --top 40 --gaps 20 --mem-fraction 0.6"
for bl in 64_1024 32_1536 96_1024 16_1536; do b=${bl%_*}; l=${bl#*_}
  step p${b}_$l 40 110 0 "$P $F8 --batch-size $b --input-len $l --out $X/p${b}_$l.json"
  grep -aE "step|wall|kernel|busy" $X/p${b}_$l.log | head -6
done
step pb64 40 110 0 "$P --batch-size 64 --input-len 1024 --out $X/pb64.json"
grep -aE "step|wall|kernel|busy" $X/pb64.log | head -6
cd $OUT && tar czf decode_mid.tgz x && rm -rf x
