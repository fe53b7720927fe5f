"""The decode tail's L2 prefetch of the o projection's weight (`kernels.attention`).

A split decode (a few long sequences) reads K/V below the GPU's bandwidth; its programs may
pull the next GEMM's weight into L2 meanwhile (`PREFETCH_MODE`, `PHASEFLIP_ATTN_PREFETCH`).
Here: the model hands the backend o_proj's weight, the backend passes it on for split plans
only, the switch is validated, and on a GPU the outputs are bitwise those without it (a
prefetch only warms a cache; eager and in a CUDA graph, FP8 and bf16 pools).
"""

from __future__ import annotations

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.attention.triton_backend import TritonAttention  # noqa: E402
from phaseflip.cache.kv_pool import KVPool  # noqa: E402
from phaseflip.config import EMBEDDED_MODEL  # noqa: E402
from phaseflip.forward_batch import ForwardBatch  # noqa: E402
from phaseflip.kernels import attention as kernels  # noqa: E402
from phaseflip.layout import Layout  # noqa: E402
from phaseflip.model.config import ModelConfig  # noqa: E402
from phaseflip.model.llama import Attention  # noqa: E402

GPU = torch.cuda.is_available()


def test_the_mode_defaults_and_the_environment_overrides(monkeypatch):
    monkeypatch.delenv(kernels.PREFETCH_ENV, raising=False)
    assert kernels.prefetch_mode() == kernels.PREFETCH_MODE
    for mode in kernels.PREFETCH_MODES:
        monkeypatch.setenv(kernels.PREFETCH_ENV, mode)
        assert kernels.prefetch_mode() == mode
    monkeypatch.setenv(kernels.PREFETCH_ENV, "yes")
    with pytest.raises(ValueError, match="PHASEFLIP_ATTN_PREFETCH='yes'"):
        kernels.prefetch_mode()


def test_weight_lines_wants_one_dense_span_on_a_gpu():
    assert kernels.weight_lines(None) is None
    assert kernels.weight_lines(torch.zeros(4, 64)) is None  # not on a GPU
    if GPU:
        w = torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda")
        for view in (w, w.t()):
            got = kernels.weight_lines(view)
            assert got.dtype == torch.uint8 and got.numel() == w.numel() * 2
            assert got.data_ptr() == w.data_ptr()
        assert kernels.weight_lines(w[:, ::2]) is None


class _Recorder:
    """An attention backend that records what it was handed."""

    name = "recorder"
    graph_capturable = False

    def __init__(self) -> None:
        self.prefetch: list[torch.Tensor | None] = []

    def forward(self, layer_id, q, k, v, batch, pool, scale, sliding_window=None, *,
                kv_stored=False, prefetch=None):
        self.prefetch.append(prefetch)
        return torch.zeros(q.shape[0], q.shape[1] * q.shape[2])


def test_the_model_hands_the_backend_its_o_projection():
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    attn = Attention(cfg, 0, Layout(), torch.float32)
    rows = 3
    q = torch.zeros(rows, attn.num_heads * attn.head_dim)
    kv = torch.zeros(rows, attn.num_kv_heads * attn.head_dim)
    backend = _Recorder()
    attn.attend(q, kv, kv, None, None, None, backend, rotated=True)
    assert backend.prefetch == [attn.o_proj.weight]


def _decode_batch(lens: list[int], gen: torch.Generator, device) -> ForwardBatch:
    total = sum(lens)
    perm = torch.randperm(total + 7, generator=gen)[:total] + 1
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    return ForwardBatch(
        input_ids=torch.zeros(len(lens), dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in lens]),
        out_cache_loc=torch.stack([perm[indptr[i + 1] - 1] for i in range(len(lens))]),
        extend_lens=[1] * len(lens), prefix_lens=[n - 1 for n in lens],
        kv_indptr=torch.tensor(indptr), kv_indices=perm.clone(),
        logits_indices=torch.arange(len(lens)), max_position=max(lens) - 1,
    ).to(device)


@pytest.mark.parametrize("splits, passed", [(3, True), (1, False)])
def test_the_backend_passes_the_weight_on_for_split_plans_only(monkeypatch, splits, passed):
    monkeypatch.setenv(kernels.PREFETCH_ENV, "on")
    seen = []
    real = kernels.weight_lines
    monkeypatch.setattr(kernels, "weight_lines", lambda w: seen.append(w) or real(w))
    device = torch.device("cuda" if GPU else "cpu")
    gen = torch.Generator().manual_seed(splits)
    batch = _decode_batch([40, 7, 23], gen, device)
    pool = KVPool(int(batch.kv_indices.max()) + 8, (0, 1), 2, 64, torch.float32, device)
    q = torch.randn(3, 8, 64, generator=gen).to(device)
    kv = torch.randn(3, 2, 64, generator=gen).to(device)
    weight = torch.randn(32, 512, device=device)
    backend = TritonAttention(decode_splits=splits, decode_min_chunk=1)
    backend.forward(0, q, kv, kv, batch, pool, 0.125, prefetch=weight)
    assert seen == ([weight] if passed else [])


def _fp8_case(batch: int, ctx: int, kv_dtype: torch.dtype, gen: torch.Generator):
    """q [B, 32, 128] bf16 over 8 KV heads of `ctx` keys each, shuffled slots; the pool in
    `kv_dtype` (FP8 with per-head scales)."""
    slots = batch * ctx + 16
    k = torch.randn(slots, 8, 128, generator=gen)
    v = torch.randn(slots, 8, 128, generator=gen)
    scales = (None, None)
    if kv_dtype == torch.float8_e4m3fn:
        scales = (torch.rand(8, generator=gen) + 0.5, torch.rand(8, generator=gen) + 0.5)
        scales = tuple(s.cuda() for s in scales)
    k, v = (t.to(kv_dtype).cuda() for t in (k, v))
    q = torch.randn(batch, 32, 128, generator=gen).to(torch.bfloat16).cuda()
    indptr = torch.arange(batch + 1).cuda() * ctx
    indices = (torch.randperm(slots - 1, generator=gen)[: batch * ctx] + 1).cuda()
    return q, k, v, indptr, indices, scales


@pytest.mark.skipif(not GPU, reason="the prefetch is PTX: a CUDA GPU only")
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_the_outputs_are_those_without_the_prefetch(monkeypatch, kv_dtype):
    gen = torch.Generator().manual_seed(0)
    q, k, v, indptr, indices, (ks, vs) = _fp8_case(12, 1_500, kv_dtype, gen)
    weight = torch.randn(4096, 4096, generator=gen).to(torch.float8_e4m3fn).cuda()
    plan = kernels.DecodePlan(num_splits=4, min_chunk=16)
    ws = kernels.decode_workspace(q.shape[0], q.shape[1], 128, plan, q.device)

    def run(out: torch.Tensor) -> torch.Tensor:
        return kernels.decode_attention(q, k, v, indptr, indices, 128**-0.5, plan, out=out,
                                        workspace=ws, k_scale=ks, v_scale=vs,
                                        prefetch=weight)

    monkeypatch.setenv(kernels.PREFETCH_ENV, "off")
    want = run(torch.empty(q.shape[0], 32 * 128, dtype=q.dtype, device=q.device)).clone()
    for mode in ("on", "first"):
        monkeypatch.setenv(kernels.PREFETCH_ENV, mode)
        eager = torch.full_like(want, float("nan"))
        assert torch.equal(run(eager), want), mode
        graphed = torch.full_like(want, float("nan"))
        run(graphed)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(graphed)
        graphed.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphed, want), mode
