# any one sm_90 GPU (~5 min): the PDL chain tests, the red check (SiLU·mul without its wait), the engine GPU tests
. tools/device/lib.sh
T="python3 -m pytest -q -p no:cacheprovider"
step tests 40 120 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py"
cp phaseflip/kernels/activation.py /tmp/act.py
sed -i 's/^    wait_previous(PDL)$/    pass  # wait removed/' phaseflip/kernels/activation.py
step red 30 80 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_pdl.py -k chain_in_a_graph"
grep -a "assert err\|AssertionError" $X/red.log | head -4
cp /tmp/act.py phaseflip/kernels/activation.py
step eng 60 200 4 "PHASEFLIP_TEST_DEVICE=cuda $T tests/test_cuda_graph.py tests/test_gpu.py -x"
cd $OUT && tar czf g.tgz x && rm -rf x
