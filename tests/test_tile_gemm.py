"""The tile GEMM (`kernels/tile_gemm.py`): the kernel against an exact product, FP8 and 16-bit
(Triton's interpreter on the CPU, compiled on a GPU), its row buckets against the decode
graphs' sizes, the shipped tables, and the routing in `model.quant.fp8` and `layers.linear`."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from phaseflip.kernels import tile_gemm  # noqa: E402
from phaseflip.kernels.tile_gemm import TileGemmConfig  # noqa: E402
from phaseflip.model import layers  # noqa: E402
from phaseflip.model.cuda_graph import capture_sizes  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = TileGemmConfig(16, 32, 64, num_warps=4, num_stages=2, group_m=4)


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w_q, w_s = fp8.quantize_rows(torch.randn(n, k, generator=g))
    x_q, x_s = fp8.quantize_tokens(torch.randn(m, k, generator=g))
    return x_q.to(DEV), x_s.to(DEV), w_q.to(DEV), w_s.to(DEV)


def _exact(x_q, x_s, w_q, w_s) -> torch.Tensor:
    acc = x_q.double().cpu() @ w_q.double().cpu().T  # FP8 products summed exactly
    return acc * x_s.double().cpu().view(-1, 1) * w_s.double().cpu().view(1, -1)


FP8 = "float8_e4m3fn"


def _half_operands(m: int, n: int, k: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).to(dtype).to(DEV),
            torch.randn(n, k, generator=g).to(dtype).to(DEV))


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (37, 64, 256), (150, 96, 128), (16, 32, 192)])
def test_fp8_kernel_matches_the_exact_product(m, n, k):
    """Ragged rows, several column tiles, a partial group of row tiles (150 rows: 10 row tiles
    in groups of 4): every output element against the float64 product."""
    x_q, x_s, w_q, w_s = _operands(m, n, k, seed=m + n + k)
    y = torch.empty(m, n, device=DEV)
    tile_gemm.tile_gemm(x_q, w_q, SMALL, x_s, w_s, out=y)
    ref = _exact(x_q, x_s, w_q, w_s)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_kernel_matches_the_exact_product_with_bias(dtype):
    x, w = _half_operands(150, 96, 128, seed=1, dtype=dtype)
    bias = torch.randn(96).to(dtype).to(DEV)
    y = torch.empty(150, 96, device=DEV)
    tile_gemm.tile_gemm(x, w, SMALL, bias=bias, out=y)
    ref = x.double().cpu() @ w.double().cpu().T + bias.double().cpu()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-5)
    y16 = tile_gemm.tile_gemm(x, w, SMALL, bias=bias)
    assert y16.dtype == dtype  # one rounding of the fp32 sums (truncated by the interpreter)
    torch.testing.assert_close(y16.double().cpu(), ref, rtol=2 ** -7, atol=1e-3)


@pytest.mark.parametrize("k,split", [(192, 3), (320, 3), (256, 8)])
def test_split_k_sums_in_split_order_and_rearms_its_counters(k, split):
    """Split-K (uneven last chunk at K=320, 8 requested but only 4 useful at K=256): exact,
    bitwise the same on a second launch (the last arrival sums the partials in split order),
    and every arrival counter back at 0 for the next launch."""
    from phaseflip.kernels.linear_workspace import workspace_for

    cfg = TileGemmConfig(16, 32, 64, num_warps=4, num_stages=2, group_m=4, split_k=split)
    x_q, x_s, w_q, w_s = _operands(40, 64, k, seed=k)
    y = tile_gemm.tile_gemm(x_q, w_q, cfg, x_s, w_s, out=torch.empty(40, 64, device=DEV))
    torch.testing.assert_close(y.double().cpu(), _exact(x_q, x_s, w_q, w_s), rtol=1e-5,
                               atol=1e-5)
    again = tile_gemm.tile_gemm(x_q, w_q, cfg, x_s, w_s, out=torch.empty(40, 64, device=DEV))
    assert torch.equal(y, again)
    assert int(workspace_for(DEV).counters.abs().sum()) == 0
    x, w = _half_operands(40, 64, k, seed=k + 1)
    y16 = tile_gemm.tile_gemm(x, w, cfg, out=torch.empty(40, 64, device=DEV))
    torch.testing.assert_close(y16.double().cpu(), x.double().cpu() @ w.double().cpu().T,
                               rtol=1e-5, atol=1e-5)


def test_warmup_sizes_the_split_workspace_for_the_real_shape(monkeypatch):
    """The warm-up compiles on proxy weights but must reserve the real N's partials: a
    capture that found the workspace too small would fail."""
    from phaseflip.kernels.linear_workspace import SplitKWorkspace

    cfg = TileGemmConfig(16, 32, 64, num_warps=4, num_stages=2, split_k=2)
    monkeypatch.setattr(tile_gemm, "table",
                        lambda device: {(160, 256, 128, FP8): cfg, (160, 96, 64, FP8): cfg})
    fresh = SplitKWorkspace(DEV)
    monkeypatch.setattr(tile_gemm, "workspace_for", lambda device: fresh)
    tile_gemm.warmup([(256, 128)], torch.float8_e4m3fn, DEV)
    tiles = 10 * (256 // 32)  # 160 rows in 16-row tiles, 256 columns in 32
    assert fresh.partials.numel() >= tiles * 2 * 16 * 32 and fresh.counters.numel() >= tiles


def test_fp8_output_is_bf16_within_one_rounding():
    x_q, x_s, w_q, w_s = _operands(70, 64, 128, seed=3)
    y = tile_gemm.tile_gemm(x_q, w_q, SMALL, x_s, w_s)
    assert y.dtype == torch.bfloat16 and y.shape == (70, 64)
    ref = _exact(x_q, x_s, w_q, w_s)
    # one bf16 ulp (the interpreter truncates where the GPU rounds to nearest)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2 ** -7, atol=1e-6)


def test_refuses_what_it_cannot_tile():
    x_q, x_s, w_q, w_s = _operands(8, 48, 64, seed=4)
    with pytest.raises(ValueError, match="does not tile"):
        tile_gemm.tile_gemm(x_q, w_q, SMALL, x_s, w_s)  # N = 48 is not whole 32-column tiles
    x_q, x_s, w_q, w_s = _operands(8, 64, 64, seed=5)
    with pytest.raises(ValueError, match="one 8- or 16-bit float dtype"):
        tile_gemm.tile_gemm(x_q.float(), w_q, SMALL, x_s, w_s)
    with pytest.raises(ValueError, match="scales"):
        tile_gemm.tile_gemm(x_q, w_q, SMALL, x_s[:4], w_s)
    with pytest.raises(ValueError, match="scales"):
        tile_gemm.tile_gemm(x_q, w_q, SMALL)
    assert tile_gemm.tile_gemm(x_q[:0], w_q, SMALL, x_s[:0], w_s).shape == (0, 64)


def test_buckets_are_the_decode_graph_sizes():
    """A decode graph pads its batch to a capture size; the table is measured per bucket, so
    each padded batch must be a bucket of its own (else its GEMM runs a shape tuned for
    more rows)."""
    sizes = [s for s in capture_sizes(tile_gemm.GEMM_MAX_M) if s >= tile_gemm.GEMM_MIN_M]
    assert tile_gemm.buckets() == sizes
    assert all(tile_gemm.m_bucket(s) == s for s in sizes)
    assert tile_gemm.m_bucket(32) is None and tile_gemm.m_bucket(1025) is None
    assert tile_gemm.m_bucket(33) == 48 and tile_gemm.m_bucket(72) == 80
    assert tile_gemm.m_bucket(129) == 144 and tile_gemm.m_bucket(257) == 288


def test_table_rows_and_pick(monkeypatch):
    rows = [{"m_bucket": 288, "n": 64, "k": 128, "dtype": FP8,
             "config": {"block_m": 64, "block_n": 32}},
            {"m_bucket": 320, "n": 64, "k": 128, "dtype": FP8, "config": None,
             "cublas_us": 1.0}]
    table = tile_gemm.parse_table(rows)
    assert table == {(288, 64, 128, FP8): TileGemmConfig(64, 32)}
    assert tile_gemm.parse_table(tile_gemm.to_rows(
        {(288, 64, 128, FP8): TileGemmConfig(64, 32), (320, 64, 128, FP8): None})) == table
    monkeypatch.setattr(tile_gemm, "table", lambda device: table)
    f8 = torch.float8_e4m3fn
    assert tile_gemm.pick(260, 64, 128, f8, DEV) == TileGemmConfig(64, 32)
    assert tile_gemm.pick(260, 64, 128, torch.bfloat16, DEV) is None  # another dtype's row
    assert tile_gemm.pick(300, 64, 128, f8, DEV) is None  # cuBLAS won that bucket
    assert tile_gemm.pick(20, 64, 128, f8, DEV) is None  # the skinny kernel's rows


def test_no_table_off_the_gpu_or_when_turned_off(monkeypatch):
    assert tile_gemm.table(torch.device("cpu")) == {}
    monkeypatch.setenv(tile_gemm.NO_TILE_GEMM_ENV, "1")
    assert tile_gemm.table(torch.device("cuda", 0)) == {}


def test_shipped_tables_hold_configs_that_tile_their_shapes():
    paths = sorted(tile_gemm.TABLES.glob("tile_gemm_*.json"))
    assert paths, "no tile GEMM table ships"
    for path in paths:
        rows = json.loads(path.read_text())
        for (bucket, n, k, dtype), cfg in tile_gemm.parse_table(rows).items():
            assert tile_gemm.m_bucket(bucket) == bucket, (path.name, bucket)
            assert cfg.fits(n, k), (path.name, bucket, n, k, cfg)
            assert cfg.block_k * getattr(torch, dtype).itemsize == 128, (path.name, cfg)


def _spy(monkeypatch) -> list:
    calls, real = [], tile_gemm.tile_gemm

    def spy(*args, **kwargs):
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(tile_gemm, "tile_gemm", spy)
    return calls


def test_fp8_rows_route_to_the_tile_gemm(monkeypatch):
    """An FP8 activation of a tabled row count runs the tile GEMM (the product must be the
    tile GEMM's, not the reference's fallback), in the activation's dtype, bias added after."""
    x_q, x_s, w_q, w_s = _operands(150, 64, 128, seed=9)
    bias = torch.randn(64, device=DEV, dtype=torch.float16)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(fp8, "_tile_gemm_config", lambda x, w: SMALL)
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: False)
    y = fp8.scaled_linear(fp8.Fp8Activation(x_q, x_s, torch.float16), w_q, w_s, bias)
    assert calls == [SMALL] and y.dtype == torch.float16
    ref = (_exact(x_q, x_s, w_q, w_s).to(torch.bfloat16).half() + bias.cpu()).double()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_16bit_rows_route_to_the_tile_gemm(monkeypatch):
    """`layers.linear` runs a tabled 16-bit shape through the tile GEMM and the rest through
    F.linear (the fused-kernel rule is forced on for the CPU tensors)."""
    x, w = _half_operands(150, 64, 128, seed=11)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(tile_gemm, "table",
                        lambda device: {(160, 64, 128, "bfloat16"): SMALL})
    y = layers.linear(x, w)
    assert calls == [SMALL]
    torch.testing.assert_close(y.double().cpu(), x.double().cpu() @ w.double().cpu().T,
                               rtol=2 ** -7, atol=1e-3)
    layers.linear(x[:100], w)  # the skinny kernel's rows: not the tile GEMM
    layers.linear(x, w[:32])  # an untabled shape
    assert calls == [SMALL]


def test_16bit_rows_fall_back_to_f_linear_for_strided_weights(monkeypatch):
    x, w = _half_operands(150, 64, 128, seed=12)
    strided = torch.empty(128, 64, dtype=w.dtype, device=DEV).t()
    strided.copy_(w)
    calls = _spy(monkeypatch)
    monkeypatch.setattr(layers, "use_fused_kernels", lambda x: True)
    monkeypatch.setattr(tile_gemm, "table",
                        lambda device: {(160, 64, 128, "bfloat16"): SMALL})
    y = layers.linear(x, strided)
    assert calls == []
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))


def test_split_k_with_a_bias():
    cfg = TileGemmConfig(16, 32, 64, num_warps=4, num_stages=2, split_k=3)
    x, w = _half_operands(40, 64, 192, seed=13)
    bias = torch.randn(64).to(torch.bfloat16).to(DEV)
    y = tile_gemm.tile_gemm(x, w, cfg, bias=bias, out=torch.empty(40, 64, device=DEV))
    ref = x.double().cpu() @ w.double().cpu().T + bias.double().cpu()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def test_refuses_a_bad_out_and_what_no_caller_sends():
    x, w = _half_operands(8, 64, 64, seed=14)
    for out in (torch.empty(64, 8, device=DEV).t(), torch.empty(8, 32, device=DEV)):
        with pytest.raises(ValueError, match="out must be"):
            tile_gemm.tile_gemm(x, w, SMALL, out=out)
    with pytest.raises(ValueError, match="float dtype"):
        tile_gemm.tile_gemm(x[:, :0], w[:, :0], TileGemmConfig(16, 32, 0))
    with pytest.raises(ValueError, match="float dtype"):
        tile_gemm.tile_gemm(x.to(torch.int8), w.to(torch.int8), SMALL)


def test_warmup_compiles_both_bias_variants_of_a_16bit_shape(monkeypatch):
    calls = []
    monkeypatch.setattr(tile_gemm, "table",
                        lambda device: {(160, 64, 128, "bfloat16"): SMALL})
    monkeypatch.setattr(tile_gemm, "tile_gemm",
                        lambda x, w, cfg, *a, bias=None, **k: calls.append(bias is not None))
    tile_gemm.warmup([(64, 128)], torch.bfloat16, DEV)
    assert sorted(calls) == [False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tabled_shapes_match_cublas_on_the_gpu():
    """Every shipped config for this GPU, at its bucket and 15 rows fewer, against cuBLAS's
    product (`_scaled_mm` for FP8, F.linear for bf16; fp32 sums in another order)."""
    table = tile_gemm.table(DEV)
    if not table:
        pytest.skip("no table ships for this GPU")
    seen = set()
    for (bucket, n, k, dtype), cfg in sorted(table.items()):
        if (cfg, n, k, dtype) in seen:
            continue
        seen.add((cfg, n, k, dtype))
        for m in (bucket, bucket - 15):
            if dtype == FP8:
                x_q, x_s, w_q, w_s = _operands(m, n, k, seed=m)
                y = tile_gemm.tile_gemm(x_q, w_q, cfg, x_s, w_s).float()
                ref = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.view(1, -1),
                                       out_dtype=torch.bfloat16).float()
            else:
                x, w = _half_operands(m, n, k, seed=m, dtype=getattr(torch, dtype))
                y = tile_gemm.tile_gemm(x, w, cfg).float()
                ref = torch.nn.functional.linear(x, w).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-2, (bucket, n, k, dtype, cfg)


def test_tuner_ships_only_clear_winners():
    """`tile_gemm_tune.winners`: the fastest correct candidate ships where it beats cuBLAS by
    the margin (split-K labels map back to their configs); a wrong one never ships."""
    tune = pytest.importorskip("benchmarks.tile_gemm_tune")
    f8 = torch.float8_e4m3fn
    split, plain = [c for c in tune.candidates(f8, 160) if c.split_k == 4][0], \
        tune.candidates(f8, 160)[0]
    rows = {("llama.down", "fp8"): {
        160: {"cublas": 50.0, split.label(): [30.0, 0.001], plain.label(): [20.0, 0.5]},
        288: {"cublas": 50.0, plain.label(): [49.5, 0.001]}}}
    entries, timings = tune.winners(rows, margin=0.02)
    assert entries[(160, 4096, 14336, FP8)] == split  # the faster one is wrong: not shipped
    assert entries[(288, 4096, 14336, FP8)] is None  # 1 % faster: within the margin
    assert timings[(288, 4096, 14336, FP8)] == {"us": 49.5, "cublas_us": 50.0}
    assert all(c.split_k == 1 for c in tune.candidates(f8, 288))


def test_cublas_rows_are_those_where_it_beat_the_skinny_kernel_too():
    rows = [{"m_bucket": 80, "n": 64, "k": 128, "dtype": FP8, "config": None,
             "cublas_us": 14.4, "skinny_us": 24.9},
            {"m_bucket": 64, "n": 64, "k": 128, "dtype": FP8, "config": None,
             "cublas_us": 14.7, "skinny_us": 9.7},
            {"m_bucket": 96, "n": 64, "k": 128, "dtype": FP8, "config": {"block_m": 64},
             "cublas_us": 14.4, "skinny_us": 20.5},
            {"m_bucket": 320, "n": 64, "k": 128, "dtype": FP8, "config": None,
             "cublas_us": 1.0}]
    assert tile_gemm.cublas_keys(rows) == {(80, 64, 128, FP8)}
    assert not tile_gemm.cublas_wins(80, 64, 128, torch.float8_e4m3fn, torch.device("cpu"))


@pytest.mark.parametrize("tiled,cublas,want", [
    (True, True, "tile"), (True, False, "tile"), (False, True, "cublas"),
    (False, False, "skinny")])
def test_fp8_rows_the_table_orders_before_the_skinny_kernel(monkeypatch, tiled, cublas, want):
    """Rows the skinny kernel could take go to the tile GEMM when the table has a config for
    them, to cuBLAS when the tuner found it faster than the skinny kernel, else to it."""
    from phaseflip.kernels import linear as linear_kernels

    x_q, x_s, w_q, w_s = _operands(80, 64, 128, seed=15)
    ran: list[str] = []
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: True)
    monkeypatch.setattr(fp8, "_tile_gemm_config", lambda x, w: SMALL if tiled else None)
    monkeypatch.setattr(tile_gemm, "cublas_wins", lambda *a: cublas)
    out = torch.zeros(80, 64, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setattr(tile_gemm, "tile_gemm", lambda *a, **k: ran.append("tile") or out)
    monkeypatch.setattr(fp8, "_scaled_mm", lambda *a: ran.append("cublas") or out)
    monkeypatch.setattr(linear_kernels, "skinny_linear",
                        lambda *a, **k: ran.append("skinny") or out)
    fp8._rows_linear(x_q, x_s.view(-1, 1), w_q, w_s, None, torch.bfloat16)
    assert ran == [want]
