"""The CUDA FP8 decode attention kernel (`kernels.attention_cuda`, sm_90 only): which launches
it takes and the workspace a split launch needs (everywhere), and on an H200 its outputs,
unsplit and split, against the float32 reference and Triton's kernel, inside a CUDA graph,
and routed to by the Triton backend."""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported

from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402
from phaseflip.kernels.attention_cuda import (  # noqa: E402
    NO_CUDA_ATTENTION_ENV,
    CudaFp8Decode,
)

FP8 = torch.float8_e4m3fn
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not SM90, reason="the kernel runs on sm_90 only")


def _layout(b=3, heads=32, kv_heads=8, d=128, q_dtype=torch.bfloat16, kv=FP8,
            idx_dtype=torch.int64):
    q = torch.zeros(b, heads, d, dtype=q_dtype)
    cache = torch.zeros(64, kv_heads, d).to(kv)
    out = torch.zeros(b, heads * d, dtype=q_dtype)
    indptr = torch.zeros(b + 1, dtype=idx_dtype)
    idx = torch.zeros(10, dtype=idx_dtype)
    scale = torch.ones(kv_heads)
    return q, cache, cache.clone(), out, indptr, idx, scale, scale.clone()


def _accepts(q, k, v, out, indptr, idx, ks, vs, order=None, window=None) -> bool:
    return CudaFp8Decode.accepts(q, k, v, out, indptr, idx, ks, vs, order, window)


def test_accepts_only_the_layout_the_kernel_reads():
    assert _accepts(*_layout())
    assert _accepts(*_layout(heads=16))  # group 2
    assert not _accepts(*_layout(heads=64))  # group 8: computed, but slower than Triton
    q, k, v, out, indptr, idx, ks, vs = _layout()
    assert not _accepts(q, k, v, out, indptr, idx, ks, vs, window=128)
    assert not _accepts(q, k, v, out, indptr, idx, None, None)
    assert not _accepts(q, k, v, out, indptr, idx, ks, vs, order=torch.zeros(3, dtype=torch.int32))
    assert not _accepts(*_layout(d=64))
    assert not _accepts(*_layout(q_dtype=torch.float16))
    assert not _accepts(*_layout(kv=torch.bfloat16))
    assert not _accepts(*_layout(idx_dtype=torch.int32))
    wide = torch.zeros(3, 32, 256, dtype=torch.bfloat16)[:, :, :128]  # head stride 256
    assert not _accepts(wide, k, v, out, indptr, idx, ks, vs)
    qkv = torch.zeros(3, 48, 128, dtype=torch.bfloat16)  # q as the qkv projection's slice
    assert _accepts(qkv[:, :32], k, v, out, indptr, idx, ks, vs)


def test_no_kernel_off_the_gpu_or_when_switched_off(monkeypatch):
    assert CudaFp8Decode.create(torch.device("cpu")) is None
    monkeypatch.setenv(NO_CUDA_ATTENTION_ENV, "1")
    assert CudaFp8Decode.create(torch.device("cuda")) is None


def _case(b, mean, group, seed=0):
    from benchmarks.fp8_decode_probe import make_case

    q, k, v, indptr, _, ks, vs = make_case(b, mean, group, seed=seed)
    # tile edges first (1, 15, 16, 17 ... keys), then the case's own lengths
    edges = torch.tensor([1, 15, 16, 17, 63, 64, 65, 130], device="cuda")[: b - 1]
    lens = torch.cat([edges, indptr.diff()[len(edges):]])
    indptr = torch.zeros_like(indptr)
    indptr[1:] = torch.cumsum(lens, 0)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    assert int(indptr[-1]) <= k.shape[0]
    idx = torch.randperm(k.shape[0], generator=gen, device="cuda")[: int(indptr[-1])]
    return q, k, v, indptr, idx, ks, vs


@gpu
@pytest.mark.parametrize("b,mean,group,ordered", [(12, 200, 4, False), (40, 300, 8, True),
                                                   (9, 700, 1, True), (70, 200, 2, False)])
def test_matches_the_reference_and_triton(b, mean, group, ordered):
    from benchmarks.fp8_decode_probe import reference
    from phaseflip.kernels.attention import decode_attention, decode_order, plan_decode

    q, k, v, indptr, idx, ks, vs = _case(b, mean, group)
    scale = 128 ** -0.5
    order = decode_order(indptr) if ordered else None
    ref = reference(q, k, v, indptr, idx, ks, vs, scale)
    kern = CudaFp8Decode.create(q.device)
    assert kern is not None
    out = torch.full((b, q.shape[1] * 128), float("nan"), device="cuda", dtype=q.dtype)
    kern(q, k, v, indptr, idx, ks, vs, scale, out, order)
    assert torch.isfinite(out).all(), "unwritten rows"
    got = out.view_as(q).float()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2
    plan = plan_decode(b, k.shape[1], 1, int(indptr.diff().max()), 132, num_splits=1)
    tri = decode_attention(q, k, v, indptr, idx, scale, plan, k_scale=ks, v_scale=vs)
    assert ((got - tri.view_as(q).float()).norm() / ref.norm()).item() < 1e-2


@gpu
def test_replays_in_a_cuda_graph_with_new_lengths():
    q, k, v, indptr, idx, ks, vs = _case(16, 200, 4)
    scale = 128 ** -0.5
    kern = CudaFp8Decode.create(q.device)
    s_indptr, s_idx = indptr.clone(), torch.zeros(8192, dtype=torch.int64, device="cuda")
    s_idx[: idx.numel()] = idx
    out = torch.empty(16, 32 * 128, device="cuda", dtype=q.dtype)
    kern(q, k, v, s_indptr, s_idx, ks, vs, scale, out)  # loaded and run before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(q, k, v, s_indptr, s_idx, ks, vs, scale, out)
    lens = indptr.diff().flip(0)  # other lengths, same total
    s_indptr[1:] = torch.cumsum(lens, 0)
    graph.replay()
    want = torch.empty_like(out)
    kern(q, k, v, s_indptr, s_idx, ks, vs, scale, want)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@gpu
def test_the_backend_routes_unsplit_fp8_decodes_to_it():
    from test_fp8_kv import run_fp8_case

    seqs = [(5, 1), (140, 1), (0, 1), (37, 1), (300, 1)]
    backend = TritonAttention(decode_splits=1)
    run_fp8_case(seqs, dtype=torch.bfloat16, num_kv_heads=8, group=4, head_dim=128,
                 backend=backend)
    assert backend._cuda is not None, "the CUDA kernel was not used"
    off = TritonAttention(decode_splits=1, cuda_decode=False)
    run_fp8_case(seqs, dtype=torch.bfloat16, num_kv_heads=8, group=4, head_dim=128,
                 backend=off)
    assert off._cuda is None


@gpu
@pytest.mark.parametrize("b,mean,group,splits,min_chunk,ordered", [
    (5, 1500, 4, 3, 256, False),  # the decode tail: few long sequences
    (12, 700, 4, 7, 64, True),
    (4, 40, 4, 4, 16, False),  # short sequences: splits past the last key exit
    (20, 2000, 2, 2, 256, True),
    (6, 900, 1, 5, 64, False),
])
def test_split_plans_match_the_reference_and_triton(b, mean, group, splits, min_chunk,
                                                    ordered):
    from benchmarks.fp8_decode_probe import reference
    from phaseflip.kernels.attention import (
        DecodePlan,
        decode_attention,
        decode_order,
        decode_workspace,
    )

    q, k, v, indptr, idx, ks, vs = _case(b, mean, group)
    scale = 128 ** -0.5
    order = decode_order(indptr) if ordered else None
    plan = DecodePlan(num_splits=splits, min_chunk=min_chunk)
    kern = CudaFp8Decode.create(q.device)
    ws = decode_workspace(b, q.shape[1], 128, plan, q.device)
    for t in ws[:3]:
        t.fill_(float("nan"))  # a split merged from unwritten partials shows
    for launch in range(2):  # new queries: the second launch's partials are not the first's
        q = q if launch == 0 else (q.float() * -0.7).to(q.dtype)
        ref = reference(q, k, v, indptr, idx, ks, vs, scale)
        out = torch.full((b, q.shape[1] * 128), float("nan"), device="cuda", dtype=q.dtype)
        kern(q, k, v, indptr, idx, ks, vs, scale, out, order, plan, ws)
        assert torch.isfinite(out).all(), "unmerged rows"
        got = out.view_as(q).float()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-2
        assert int(ws[3].abs().sum()) == 0, "split counters left armed"
    # the Triton kernel on the same workspace and counters, after the CUDA launches
    tri = decode_attention(q, k, v, indptr, idx, scale, plan, workspace=ws, k_scale=ks,
                           v_scale=vs, order=order)
    assert ((got - tri.view_as(q).float()).norm() / ref.norm()).item() < 1e-2
    assert int(ws[3].abs().sum()) == 0


@gpu
def test_a_split_launch_replays_in_a_cuda_graph_with_new_lengths():
    from benchmarks.fp8_decode_probe import reference
    from phaseflip.kernels.attention import DecodePlan, decode_order, decode_workspace

    q, k, v, indptr, idx, ks, vs = _case(6, 900, 4)
    scale = 128 ** -0.5
    plan = DecodePlan(num_splits=5, min_chunk=64)
    kern = CudaFp8Decode.create(q.device)
    ws = decode_workspace(6, 32, 128, plan, q.device)
    s_indptr, s_idx = indptr.clone(), torch.zeros(16384, dtype=torch.int64, device="cuda")
    s_idx[: idx.numel()] = idx
    order = decode_order(s_indptr)  # re-sorted inside the graph at every replay
    out = torch.empty(6, 32 * 128, device="cuda", dtype=q.dtype)

    def step() -> None:
        order.copy_(decode_order(s_indptr))
        kern(q, k, v, s_indptr, s_idx, ks, vs, scale, out, order, plan, ws)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for lens in (indptr.diff().flip(0), indptr.diff().roll(2)):  # other active split counts
        s_indptr[1:] = torch.cumsum(lens, 0)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(q, k, v, s_indptr, s_idx[: int(s_indptr[-1])], ks, vs, scale)
        assert ((out.view_as(q).float() - ref).norm() / ref.norm()).item() < 1e-2
        assert int(ws[3].abs().sum()) == 0, "split counters left armed by a replay"
        want = torch.empty_like(out)
        kern(q, k, v, s_indptr, s_idx, ks, vs, scale, want, None, plan, ws)
        assert torch.equal(out, want)


@gpu
def test_the_backend_routes_split_fp8_decodes_under_cuda_splits(monkeypatch):
    from test_fp8_kv import run_fp8_case

    calls = []
    real = CudaFp8Decode.__call__
    monkeypatch.setattr(CudaFp8Decode, "__call__",
                        lambda self, *a, **kw: calls.append(a[10]) or real(self, *a, **kw))
    seqs = [(500, 1), (1400, 1), (0, 1), (37, 1), (3000, 1)]
    for splits in (True, False):
        calls.clear()
        backend = TritonAttention(decode_splits=3, decode_min_chunk=64, cuda_splits=splits)
        run_fp8_case(seqs, dtype=torch.bfloat16, num_kv_heads=8, group=4, head_dim=128,
                     backend=backend)
        assert [p.num_splits for p in calls] == ([3, 3] if splits else [])


def test_a_split_launch_refuses_a_missing_or_short_workspace():
    from phaseflip.kernels.attention import DecodePlan, decode_workspace
    from phaseflip.kernels.attention_cuda import _split_workspace

    q = torch.zeros(3, 32, 128)
    plan = DecodePlan(num_splits=4, min_chunk=64)
    ws = decode_workspace(3, 32, 128, plan, torch.device("cpu"))
    assert _split_workspace(ws, q, 8, 4) is not None
    with pytest.raises(ValueError, match="needs its workspace"):
        _split_workspace(None, q, 8, 4)
    with pytest.raises(ValueError, match="does not hold 3 sequences x 32 heads x 5 splits"):
        _split_workspace(ws, q, 8, 5)
    short = decode_workspace(2, 32, 128, plan, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not hold"):
        _split_workspace(short, q, 8, 4)
    wider = decode_workspace(3, 32, 128, DecodePlan(num_splits=8, min_chunk=64),
                             torch.device("cpu"))  # large enough, but another row stride
    with pytest.raises(ValueError, match="does not hold"):
        _split_workspace(wider, q, 8, 4)
    assert _split_workspace(decode_workspace(5, 32, 128, plan, torch.device("cpu")), q, 8, 4)
    strided = list(ws)
    strided[3] = torch.zeros(2 * 3 * 8, dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="does not hold"):
        _split_workspace(tuple(strided), q, 8, 4)


def test_the_kernel_source_ships_with_the_package():
    from pathlib import Path

    from phaseflip.kernels.attention_cuda import SOURCE

    assert SOURCE.exists()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert '"kernels/csrc/*.cu"' in pyproject, "a wheel would lack the CUDA source"
