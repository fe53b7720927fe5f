# any one sm_90 GPU (~5 min): the PDL chain tests, the red check (SiLU·mul without its wait), the engine GPU tests
. tools/device/lib.sh
pdl_checks
step eng 60 200 4 "PHASEFLIP_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu.py -x"
cd $OUT && tar czf g.tgz x && rm -rf x
