"""Programmatic dependent launch (`phaseflip.kernels.pdl`): when it is on, and the decode
chains that depend on it for correctness.

The first chain is the norm → skinny GEMM pattern: a GEMM launched with PDL prefetches its
weights before its `griddepcontrol.wait`; one that read x before the wait would read the
previous round's x (the buffers are reused across rounds, and each round's x differs). The
second is whole decode layers (norm, qkv, rotary + KV store, decode attention, quantization,
o, norm, gate_up, SiLU·mul, down), every kernel between the GEMMs launched with PDL too and
waiting at its start while the kernel before it signals early: replayed from a CUDA graph it
must equal the same kernels run one at a time. On a GPU before sm_90, on the CPU and with
`PHASEFLIP_NO_PDL=1` nothing launches with PDL; there the chains run as plain launches (and
the graph test of the layers is skipped: it would test nothing).
"""

from __future__ import annotations

from collections.abc import Callable

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


def test_the_chain_kernels_launch_with_pdl_unless_switched_to_gemms_only(monkeypatch):
    """The kernels between GEMMs take `chain_launch_options`: PDL where the GEMMs have it,
    nothing under `PHASEFLIP_PDL_GEMMS_ONLY=1` (the A/B of that scope) or on the CPU."""
    assert pdl.chain_launch_options(torch.device("cpu")) == {}
    if DEVICE.type == "cuda":
        assert pdl.chain_launch_options(DEVICE) == pdl.launch_options(DEVICE)
        monkeypatch.setenv(pdl.GEMMS_ONLY_ENV, "1")
        assert pdl.chain_launch_options(DEVICE) == {}


class _Layer:
    """One decoder layer's weights and KV pool (`hidden`, 32 query and 8 KV heads of
    `hidden / 32`, `inter` intermediate; on the GPU the 8B shapes), the pool holding `ctx`
    keys of each of `seqs` sequences before the step's own; FP8: W8A8 projections and an e4m3
    pool with per-head scales. The decode plan and its workspace are made here, outside any
    capture, as the engine makes them (a memset inside the graph would stand between the
    rotary kernel and the attention and hide the attention's wait)."""

    def __init__(self, gen: torch.Generator, seqs: int, ctx: int, fp8: bool, hidden: int,
                 inter: int) -> None:
        from phaseflip.kernels.attention import decode_workspace, num_sms, plan_decode
        from phaseflip.model.quant.fp8 import quantize_rows

        def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            w = torch.randn(n, k, device=DEVICE, generator=gen, dtype=torch.bfloat16) * k**-0.5
            return quantize_rows(w) if fp8 else (w, None)

        self.fp8, self.hidden, self.dim = fp8, hidden, hidden // 32
        self.qkv, self.o = weight(hidden * 3 // 2, hidden), weight(hidden, hidden)
        self.gate_up, self.down = weight(2 * inter, hidden), weight(hidden, inter)
        self.norm_w = torch.rand(hidden, device=DEVICE, generator=gen,
                                 dtype=torch.bfloat16) + 0.5
        slots = seqs * (ctx + 1)
        pool_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        self.k = torch.randn(slots, 8, self.dim, device=DEVICE, generator=gen).to(pool_dtype)
        self.v = torch.randn(slots, 8, self.dim, device=DEVICE, generator=gen).to(pool_dtype)
        self.scales = ((torch.rand(8, device=DEVICE, generator=gen) * 0.02 + 0.01,
                        torch.rand(8, device=DEVICE, generator=gen) * 0.02 + 0.01)
                       if fp8 else (None, None))
        self.indptr = torch.arange(0, slots + 1, ctx + 1, device=DEVICE)
        self.indices = torch.randperm(slots, device=DEVICE, generator=gen)
        self.new_slots = self.indices[self.indptr[1:] - 1]
        self.positions = torch.full((seqs,), ctx, device=DEVICE, dtype=torch.int64)
        inv = 1.0 / (500000.0 ** (torch.arange(0, self.dim, 2, device=DEVICE).float()
                                  / self.dim))
        angles = torch.arange(ctx + 1, device=DEVICE).float()[:, None] * inv[None, :]
        self.cos, self.sin = angles.cos().contiguous(), angles.sin().contiguous()
        # the split path (partials, the last arrival's merge) as the engine plans it on a GPU;
        # many sequences run unsplit and write directly
        self.plan = plan_decode(seqs, 8, 1, ctx + 1, num_sms(DEVICE), min_chunk=16,
                                num_splits=None if DEVICE.type == "cuda" else 3)
        assert self.plan.num_splits > 1 or seqs > 64
        self.ws = decode_workspace(seqs, 32, self.dim, self.plan, DEVICE)


Sync = Callable[[torch.Tensor], torch.Tensor]
# one layer against torch, relative error. CPU, small shapes: 0.007 (bf16) and 0.056 (FP8:
# two FP8 pipelines whose inputs differ in the last bits round some elements a step apart);
# with the step's k stored unrotated, 0.23 and 0.71
TOLERANCE = {False: 0.03, True: 0.1}


def _gemm(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None],
          x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The decode GEMM for x's rows: the skinny kernel up to 128, the tile GEMM past it (one
    fixed launch shape with split-K; the engine's comes from the card's table)."""
    from phaseflip.kernels.tile_gemm import TileGemmConfig, tile_gemm

    if x.shape[0] > 128:
        return tile_gemm(x, w[0], TileGemmConfig(64, 128, split_k=2), x_scale, w[1])
    if w[1] is None:
        return skinny_linear(x, w[0])
    return skinny_linear(x, w[0], weight_scale=w[1], x_scale=x_scale, out_dtype=torch.bfloat16)


def _linear(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None],
            done: Sync) -> torch.Tensor:
    from phaseflip.kernels.fp8_quant import per_token_quant

    if w[1] is None:
        return done(_gemm(x, w))
    x_q, x_scale = per_token_quant(x)
    return done(_gemm(done(x_q), w, x_scale))


def _decode_layer(x: torch.Tensor, layer: _Layer, sync: bool) -> torch.Tensor:
    """norm → qkv → rotary + KV store → decode attention → [quant →] o → norm → gate_up →
    SiLU·mul [+ quant] → down: every kernel the decode chain launches with PDL (the skinny
    GEMMs up to 128 sequences, the tile GEMMs past it). `sync`: a device sync after each
    kernel, so none overlaps the one before (the reference)."""
    from phaseflip.kernels.activation import silu_and_mul, silu_and_mul_fp8
    from phaseflip.kernels.attention import decode_attention
    from phaseflip.kernels.rope import rotary_store_kv

    def done(t: torch.Tensor) -> torch.Tensor:
        if sync and DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return t

    seqs, hidden, dim = x.shape[0], layer.hidden, layer.dim
    h = done(rms_norm(x, layer.norm_w, 1e-6))
    qkv = _linear(h, layer.qkv, done)
    q = qkv[:, :hidden].view(seqs, 32, dim)
    k = qkv[:, hidden:hidden + 8 * dim].view(seqs, 8, dim)
    v = qkv[:, hidden + 8 * dim:].view(seqs, 8, dim)
    k_scale, v_scale = layer.scales
    done(rotary_store_kv(q, k, v, layer.positions, layer.cos, layer.sin, layer.new_slots,
                         layer.k, layer.v, k_scale, v_scale))
    attn = done(decode_attention(q, layer.k, layer.v, layer.indptr, layer.indices, dim**-0.5,
                                 layer.plan, workspace=layer.ws, k_scale=k_scale,
                                 v_scale=v_scale))
    h = done(rms_norm(_linear(attn, layer.o, done), layer.norm_w, 1e-6))
    gate_up = _linear(h, layer.gate_up, done)
    if not layer.fp8:
        return done(_gemm(done(silu_and_mul(gate_up)), layer.down))
    _, a_q, a_scale = silu_and_mul_fp8(gate_up)
    return done(_gemm(done(a_q), layer.down, a_scale))


def _layers(fp8: bool, seqs: int, count: int = 3) -> tuple[list[_Layer], torch.Tensor]:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden, inter, ctx = (4096, 14336, 300) if DEVICE.type == "cuda" else (256, 256, 24)
    layers = [_Layer(gen, seqs, ctx, fp8, hidden, inter) for _ in range(count)]
    return layers, torch.randn(seqs, hidden, device=DEVICE, generator=gen, dtype=torch.bfloat16)


def _forward(x: torch.Tensor, layers: list[_Layer], sync: bool) -> torch.Tensor:
    for layer in layers:
        x = _decode_layer(x, layer, sync)
    return x


def _ref_pool(pool: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor,
              rows: torch.Tensor) -> torch.Tensor:
    """`pool` in float32 (times its per-head scales) with `rows` [T, KVH, D] stored at
    `slots` as the pool's dtype holds them (e4m3: divided by the scale, clamped, rounded)."""
    out = pool.float() * (scale[None, :, None] if scale is not None else 1)
    if scale is None:
        out[slots] = rows.to(pool.dtype).float()
    else:
        q = (rows / scale[None, :, None]).clamp(-448, 448).to(pool.dtype)
        out[slots] = q.float() * scale[None, :, None]
    return out


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c[:, None] - x2 * s[:, None], x2 * c[:, None] + x1 * s[:, None]], -1)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_decode_layer_chain_matches_the_torch_reference(fp8):
    """The chain the graph test below replays is a real decode layer: one layer of it against
    torch ops (norm, linear, rotary, the step's k and v stored into a copy of the pool,
    attention over it, SiLU·mul), so a graph replay that equals the serialised kernels
    equals the model's arithmetic too. (CPU: small shapes through the interpreter.)"""
    (layer,), x = _layers(fp8, 4, count=1)
    ks, vs = layer.scales
    k_before, v_before = layer.k.clone(), layer.v.clone()
    got = _decode_layer(x, layer, sync=True).float()

    def lin(t: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        t = t.float()
        if not fp8:
            return F.linear(t, w[0].float())
        scale = (t.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-12)  # per token, as W8A8
        t = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return F.linear(t, w[0].float() * w[1][:, None])

    dim, hid = layer.dim, layer.hidden
    qkv = lin(_ref_norm(x, layer.norm_w).float(), layer.qkv)
    c, s = layer.cos[layer.positions], layer.sin[layer.positions]
    q = _rotate(qkv[:, :hid].view(4, 32, dim), c, s)
    k = _rotate(qkv[:, hid:hid + 8 * dim].view(4, 8, dim), c, s)
    pool_k = _ref_pool(k_before, ks, layer.new_slots, k)
    pool_v = _ref_pool(v_before, vs, layer.new_slots, qkv[:, hid + 8 * dim:].view(4, 8, dim))
    outs = []
    for b in range(4):
        idx = layer.indices[layer.indptr[b]:layer.indptr[b + 1]]
        keys = pool_k[idx].repeat_interleave(4, dim=1)
        vals = pool_v[idx].repeat_interleave(4, dim=1)
        p = torch.einsum("hd,nhd->hn", q[b], keys).mul(dim**-0.5).softmax(-1)
        outs.append(torch.einsum("hn,nhd->hd", p, vals).reshape(-1))
    h = _ref_norm(lin(torch.stack(outs), layer.o).to(torch.bfloat16), layer.norm_w).float()
    gate, up = lin(h, layer.gate_up).chunk(2, dim=-1)
    want = lin(F.silu(gate) * up, layer.down)
    err = ((got - want).norm() / want.norm()).item()
    assert err < TOLERANCE[fp8], err


@pytest.mark.skipif(DEVICE.type != "cuda", reason="PDL needs a GPU (the CPU runs plain launches)")
@pytest.mark.parametrize("seqs", [16, 256])  # skinny GEMMs and split attention; tile GEMMs
@pytest.mark.parametrize("fp8", [False, True])
def test_a_decode_layer_chain_in_a_graph_equals_the_serialised_kernels(fp8, seqs,
                                                                       monkeypatch):
    """Three 8B-shaped decode layers captured in one CUDA graph and replayed on new inputs:
    every replay equals the same kernels run one at a time (a sync after each). A kernel of
    the chain that read its input before its `griddepcontrol.wait` would read what the
    previous replay left there (each kernel before it signals its dependents early), and the
    output would be another step's. The tile GEMMs (256 sequences) launch with PDL here
    whether or not that is the default (`tile_gemm.PDL_LAUNCH`)."""
    from phaseflip.kernels import tile_gemm

    if not pdl.chain_launch_options(DEVICE):
        pytest.skip("the chain does not launch with PDL here: nothing to test")
    monkeypatch.setattr(tile_gemm, "PDL_LAUNCH", True)
    layers, x = _layers(fp8, seqs)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    _forward(x, layers, sync=False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _forward(x, layers, sync=False)
    for _ in range(4):
        x.copy_(torch.randn(x.shape, device=DEVICE, generator=gen, dtype=torch.bfloat16))
        graph.replay()
        got = out.float().clone()
        want = _forward(x, layers, sync=True).float()
        # the same deterministic kernels (split sums and merges in a fixed order): expected
        # bitwise; a stale row or tile reads as ~0.1 or more
        err = ((got - want).norm() / want.norm()).item()
        assert err < 1e-5, err
