"""The FP8 tile GEMM (`kernels/fp8_gemm.py`): the kernel against an exact product (Triton's
interpreter on the CPU, compiled on a GPU), its row buckets against the decode graphs' sizes,
the shipped tables, and the routing in `model.quant.fp8`."""

import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from phaseflip.kernels import fp8_gemm  # noqa: E402
from phaseflip.kernels.fp8_gemm import Fp8GemmConfig  # noqa: E402
from phaseflip.model.cuda_graph import capture_sizes  # noqa: E402
from phaseflip.model.quant import fp8  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SMALL = Fp8GemmConfig(16, 32, 64, num_warps=4, num_stages=2, group_m=4)


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w_q, w_s = fp8.quantize_rows(torch.randn(n, k, generator=g))
    x_q, x_s = fp8.quantize_tokens(torch.randn(m, k, generator=g))
    return x_q.to(DEV), x_s.to(DEV), w_q.to(DEV), w_s.to(DEV)


def _exact(x_q, x_s, w_q, w_s) -> torch.Tensor:
    acc = x_q.double().cpu() @ w_q.double().cpu().T  # FP8 products summed exactly
    return acc * x_s.double().cpu().view(-1, 1) * w_s.double().cpu().view(1, -1)


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (37, 64, 256), (150, 96, 128), (16, 32, 192)])
def test_kernel_matches_the_exact_product(m, n, k):
    """Ragged rows, several column tiles, a partial group of row tiles (150 rows: 10 row tiles
    in groups of 4): every output element against the float64 product."""
    x_q, x_s, w_q, w_s = _operands(m, n, k, seed=m + n + k)
    y = torch.empty(m, n, device=DEV)
    fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, SMALL, out=y)
    ref = _exact(x_q, x_s, w_q, w_s)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=1e-5, atol=1e-5)


def test_bf16_output_within_one_rounding():
    x_q, x_s, w_q, w_s = _operands(70, 64, 128, seed=3)
    y = fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, SMALL)
    assert y.dtype == torch.bfloat16 and y.shape == (70, 64)
    ref = _exact(x_q, x_s, w_q, w_s)
    # one bf16 ulp (the interpreter truncates where the GPU rounds to nearest)
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2 ** -7, atol=1e-6)


def test_refuses_what_it_cannot_tile():
    x_q, x_s, w_q, w_s = _operands(8, 48, 64, seed=4)
    with pytest.raises(ValueError, match="does not tile"):
        fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, SMALL)  # N = 48 is not whole 32-column tiles
    x_q, x_s, w_q, w_s = _operands(8, 64, 64, seed=5)
    with pytest.raises(ValueError, match="FP8"):
        fp8_gemm.fp8_gemm(x_q.float(), x_s, w_q, w_s, SMALL)
    with pytest.raises(ValueError, match="scales"):
        fp8_gemm.fp8_gemm(x_q, x_s[:4], w_q, w_s, SMALL)
    assert fp8_gemm.fp8_gemm(x_q[:0], x_s[:0], w_q, w_s, SMALL).shape == (0, 64)


def test_buckets_are_the_decode_graph_sizes():
    """A decode graph pads its batch to a capture size; the table is measured per bucket, so
    each padded batch must be a bucket of its own (else its GEMM runs a shape tuned for
    more rows)."""
    sizes = [s for s in capture_sizes(fp8_gemm.GEMM_MAX_M) if s >= fp8_gemm.GEMM_MIN_M]
    assert fp8_gemm.buckets() == sizes
    assert all(fp8_gemm.m_bucket(s) == s for s in sizes)
    assert fp8_gemm.m_bucket(128) is None and fp8_gemm.m_bucket(1025) is None
    assert fp8_gemm.m_bucket(129) == 144 and fp8_gemm.m_bucket(257) == 288


def test_table_rows_and_pick(monkeypatch):
    rows = [{"m_bucket": 288, "n": 64, "k": 128, "config": {"block_m": 64, "block_n": 32}},
            {"m_bucket": 320, "n": 64, "k": 128, "config": None, "cublas_us": 1.0}]
    table = fp8_gemm.parse_table(rows)
    assert table == {(288, 64, 128): Fp8GemmConfig(64, 32)}
    assert fp8_gemm.parse_table(fp8_gemm.to_rows({(288, 64, 128): Fp8GemmConfig(64, 32),
                                                  (320, 64, 128): None})) == table
    monkeypatch.setattr(fp8_gemm, "table", lambda device: table)
    assert fp8_gemm.pick(260, 64, 128, DEV) == Fp8GemmConfig(64, 32)
    assert fp8_gemm.pick(300, 64, 128, DEV) is None  # cuBLAS won that bucket
    assert fp8_gemm.pick(100, 64, 128, DEV) is None  # the skinny kernel's rows


def test_no_table_off_the_gpu_or_when_turned_off(monkeypatch):
    assert fp8_gemm.table(torch.device("cpu")) == {}
    monkeypatch.setenv(fp8_gemm.NO_FP8_GEMM_ENV, "1")
    assert fp8_gemm.table(torch.device("cuda", 0)) == {}


def test_shipped_tables_hold_configs_that_tile_their_shapes():
    paths = sorted(fp8_gemm.TABLES.glob("fp8_gemm_*.json"))
    assert paths, "no FP8 GEMM table ships"
    for path in paths:
        rows = json.loads(path.read_text())
        for (bucket, n, k), cfg in fp8_gemm.parse_table(rows).items():
            assert fp8_gemm.m_bucket(bucket) == bucket, (path.name, bucket)
            assert cfg.fits(n, k), (path.name, bucket, n, k, cfg)


def test_rows_linear_routes_tabled_rows_to_the_tile_gemm(monkeypatch):
    """An FP8 activation of a tabled row count runs the tile GEMM (the product must be the
    tile GEMM's, not the reference's fallback), in the activation's dtype, bias added after."""
    x_q, x_s, w_q, w_s = _operands(150, 64, 128, seed=9)
    bias = torch.randn(64, device=DEV, dtype=torch.float16)
    calls = []
    real = fp8_gemm.fp8_gemm

    def spy(*args, **kwargs):
        calls.append(args[-1])
        return real(*args, **kwargs)

    monkeypatch.setattr(fp8, "_tile_gemm_config", lambda x, w: SMALL)
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: False)
    monkeypatch.setattr(fp8_gemm, "fp8_gemm", spy)
    y = fp8.scaled_linear(fp8.Fp8Activation(x_q, x_s, torch.float16), w_q, w_s, bias)
    assert calls == [SMALL] and y.dtype == torch.float16
    ref = (_exact(x_q, x_s, w_q, w_s).to(torch.bfloat16).half() + bias.cpu()).double()
    torch.testing.assert_close(y.double().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_tile_gemm_config_needs_cuda():
    x_q, _, w_q, _ = _operands(150, 64, 128, seed=10)
    if DEV.type == "cpu":
        assert fp8._tile_gemm_config(x_q, w_q) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_tabled_shapes_match_cublas_on_the_gpu():
    """Every shipped config for this GPU, at its bucket and one row past the bucket below,
    against `_scaled_mm`'s product (same FP8 inputs; fp32 sums in another order)."""
    table = fp8_gemm.table(DEV)
    if not table:
        pytest.skip("no table ships for this GPU")
    seen = set()
    for (bucket, n, k), cfg in sorted(table.items()):
        if (cfg, n, k) in seen:
            continue
        seen.add((cfg, n, k))
        for m in (bucket, bucket - 15):
            x_q, x_s, w_q, w_s = _operands(m, n, k, seed=m)
            y = fp8_gemm.fp8_gemm(x_q, x_s, w_q, w_s, cfg).float()
            ref = torch._scaled_mm(x_q, w_q.t(), scale_a=x_s, scale_b=w_s.view(1, -1),
                                   out_dtype=torch.bfloat16).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-2, (bucket, n, k, cfg)
