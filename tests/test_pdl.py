"""Programmatic dependent launch (`phaseflip.kernels.pdl`): when it is on, and a GEMM chain
that depends on it for correctness.

The chain is the decode layer's pattern: a norm writes x, a skinny GEMM launched with PDL (its
tensor-core loop: 4 and 16 rows) reads it, the next norm reads the GEMM's output, and so on,
each GEMM prefetching its weights before its `griddepcontrol.wait`. A GEMM that read x before
the wait would read the previous round's x (the buffers are reused across rounds, and each
round's x differs), so the chain's output would not equal the reference. On a GPU before
sm_90, on the CPU and with `PHASEFLIP_NO_PDL=1` nothing launches with PDL; there the chain
runs as plain launches.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels import pdl  # noqa: E402
from phaseflip.kernels.linear import skinny_linear  # noqa: E402
from phaseflip.kernels.norm import rms_norm  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_pdl_is_off_on_the_cpu_and_when_switched_off(monkeypatch):
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {}
    if DEVICE.type == "cuda":
        want = torch.cuda.get_device_capability() >= (9, 0)
        assert pdl.pdl_enabled(DEVICE) == want
        monkeypatch.setenv(pdl.NO_PDL_ENV, "1")
        assert not pdl.pdl_enabled(DEVICE)


def _chain(x: torch.Tensor, weights: list[torch.Tensor], norm_w: torch.Tensor,
           kernels: bool) -> torch.Tensor:
    for w in weights:
        x = rms_norm(x, norm_w, 1e-6) if kernels else _ref_norm(x, norm_w)
        x = skinny_linear(x, w) if kernels else F.linear(x.float(), w.float()).to(x.dtype)
    return x


def _ref_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype).float()
    return (w.float() * y).to(x.dtype)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="PDL needs a GPU (the CPU runs plain launches)")
@pytest.mark.parametrize("rows", [4, 16])  # the tensor-core loop, launched with PDL
def test_a_norm_gemm_chain_in_a_graph_equals_the_reference(rows):
    """20 norm → GEMM rounds of 4096 (weights 4096 x 4096 bf16, far past L2), captured in
    one CUDA graph and replayed on new inputs: every replay equals the eager reference."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    weights = [torch.randn(4096, 4096, device=DEVICE, generator=gen, dtype=torch.bfloat16)
               * 4096**-0.5 for _ in range(20)]
    norm_w = torch.rand(4096, device=DEVICE, generator=gen, dtype=torch.bfloat16) + 0.5
    x = torch.randn(rows, 4096, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    _chain(x, weights, norm_w, kernels=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, weights, norm_w, kernels=True)
    for _ in range(5):
        x.copy_(torch.randn(rows, 4096, device=DEVICE, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        want = _chain(x, weights, norm_w, kernels=False)
        err = ((out.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 0.1, err  # a read before the wait: ~1.4 (another round's x)
