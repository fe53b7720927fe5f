"""Skinny-GEMM kernel (`phaseflip.kernels.linear`) against `torch.nn.functional.linear`.

Runs on CUDA when present, else on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`,
set here before the kernel is defined); skipped when triton is not installed. Interpreter
configs are pinned to BLOCK_N 16 and BLOCK_K 64 (ew) / 32 (dot) so tiny shapes cross every
edge: N 1 / 17 / 256 (one partial row tile, a full tile plus one row, 16 full tiles), K 64 /
100 / 512 (one or two steps, a ragged last step, 8-16 steps), M 1 / 3 / 8 / 16 (one row, padded
rows, ew's 8-row maximum, dot's 16-row minimum), split-K 3 (chunks that come out as 1, 2 or 3
splits, some ragged). Outputs are NaN-filled first so an unwritten element fails.

Bounds on ||y - ref|| / ||ref||, ref = F.linear in fp32 of the same (already rounded) inputs:
fp32 1e-5 (IEEE dots, no tf32; measured ~2e-7 on CPU), fp16 / bf16 1e-2 (rounding the output
alone costs ~2^-9 RMS; measured 1e-4 / 3e-3 on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpret_without_cuda

INTERPRETED = interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from phaseflip.kernels import linear, linear_configs, linear_workspace  # noqa: E402
from phaseflip.kernels.linear import skinny_linear  # noqa: E402
from phaseflip.kernels.linear_configs import SkinnyConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# Pinned interpreter configs (on CUDA the same small shapes are valid launch shapes too), one
# per inner loop with and without split-K.
VARIANTS = {
    f"{loop}{suffix}": SkinnyConfig(16, block_k, 4, 1, split, loop)
    for loop, block_k in (("ew", 64), ("dot", 32)) for suffix, split in (("", 1), ("_split", 3))
}


def serves(variant: str, m: int) -> bool:
    """The M range each loop is picked for: ew M <= 8, dot any M."""
    return m <= 8 or VARIANTS[variant].loop == "dot"


def check(m: int, n: int, k: int, cfg: SkinnyConfig | None, *, bias: bool,
          dtype: torch.dtype = torch.float32, seed: int = 0,
          workspace: linear.SplitKWorkspace | None = None) -> float:
    """Relative error of skinny_linear vs fp32 F.linear on fresh random inputs (asserted)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    got = skinny_linear(x, w, b, out, config=cfg, workspace=workspace)
    assert got.data_ptr() == out.data_ptr() and got.shape == (m, n)
    assert torch.isfinite(got).all(), "unwritten or non-finite output"
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < BOUND[dtype], f"relative error {err:.3g} >= {BOUND[dtype]} ({cfg})"
    return err


# Every M x N x K x variant the variant serves (candidate_configs never picks the others).
CASES = [(m, n, k, v) for m in (1, 3, 8, 16) for n in (1, 17, 256) for k in (64, 100, 512)
         for v in VARIANTS if serves(v, m)]


@pytest.mark.parametrize("m,n,k,variant", CASES)
def test_matches_reference(m, n, k, variant):
    # Bias on for half the shapes of every variant (and both states on every M, N and K).
    check(m, n, k, VARIANTS[variant], bias=(m + n + k // 4) % 2 == 1, seed=m * n + k)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bias_on_and_off(variant, bias):
    check(3 if serves(variant, 3) else 1, 17, 100, VARIANTS[variant], bias=bias, seed=7)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_half_precision(variant, dtype):
    for m, n, k in [(1, 17, 100), (4, 33, 512), (16, 20, 96)]:
        if serves(variant, m):
            check(m, n, k, VARIANTS[variant], bias=True, dtype=dtype, seed=m + n)


def test_default_config_path():
    # No pinned config: the interpreter/GPU heuristic (and split planning) picks one.
    for m, n, k in [(1, 40, 200), (5, 40, 200), (16, 40, 200)]:
        check(m, n, k, None, bias=m == 5)


def test_split_counters_rearm_between_launches():
    # The last arrival of each tile resets its counter, so back-to-back launches on one
    # workspace (as in a CUDA graph) need no memset.
    ws = linear.SplitKWorkspace(DEVICE)
    for seed, (m, n, k) in enumerate([(2, 40, 200), (1, 17, 100), (8, 40, 512)]):
        for variant in ("ew_split", "dot_split"):
            if serves(variant, m):
                check(m, n, k, VARIANTS[variant], bias=True, seed=seed, workspace=ws)
                assert int(ws.counters.sum()) == 0


def test_leading_dims_strides_and_out():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 80, generator=gen).to(DEVICE)
    b = torch.randn(24, generator=gen).to(DEVICE)
    x3 = torch.randn(2, 3, 80, generator=gen).to(DEVICE)  # [..., K] like F.linear
    got = skinny_linear(x3, w, b, config=VARIANTS["ew_split"])
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, F.linear(x3, w, b), rtol=1e-5, atol=1e-5)
    wide = torch.randn(4, 96, generator=gen).to(DEVICE)[:, :80]  # row stride 96
    out = torch.empty(4, 24, device=DEVICE)
    assert skinny_linear(wide, w, None, out, config=VARIANTS["dot_split"]) is out
    torch.testing.assert_close(out, F.linear(wide, w), rtol=1e-5, atol=1e-5)
    xt = torch.randn(80, 3, generator=gen).to(DEVICE).t()  # K not contiguous: copied
    torch.testing.assert_close(skinny_linear(xt, w, config=VARIANTS["ew"]), F.linear(xt, w),
                               rtol=1e-5, atol=1e-5)


def test_empty_inputs():
    w = torch.randn(5, 8, device=DEVICE)
    assert skinny_linear(torch.randn(0, 8, device=DEVICE), w).shape == (0, 5)
    b = torch.randn(3, device=DEVICE)
    y = skinny_linear(torch.randn(2, 0, device=DEVICE), torch.randn(3, 0, device=DEVICE), b)
    torch.testing.assert_close(y, b.expand(2, 3))


def test_rejects_bad_inputs():
    w = torch.randn(5, 8, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear(torch.randn(1, 7, device=DEVICE), w)
    with pytest.raises(ValueError, match="does not match"):
        skinny_linear(torch.randn(1, 8, device=DEVICE, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="at most"):
        skinny_linear(torch.randn(linear_configs.KERNEL_MAX_M + 1, 8, device=DEVICE), w)
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(torch.randn(2, 8, device=DEVICE), w, out=torch.empty(2, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_linear(torch.randn(2, 8, device=DEVICE), torch.randn(8, 5, device=DEVICE).t())


@pytest.mark.parametrize("k,block_k,split", [
    (4096, 512, 3), (4096, 128, 5), (100, 32, 3), (64, 32, 3), (512, 32, 3), (32, 32, 4),
    (14336, 512, 1), (7, 32, 2),
])
def test_plan_splits_cover_k_without_empty_chunks(k, block_k, split):
    num, chunk = linear_configs.plan_splits(k, block_k, split)
    assert chunk % block_k == 0 and 1 <= num <= max(split, 1)
    assert (num - 1) * chunk < k <= num * chunk


# Shapes the kernel serves: (name, N, K) for Llama-3.1-8B and Qwen3-8B, and their TP=2 halves
# (column-parallel layers halve N, row-parallel halve K).
MODEL_SHAPES = {
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096),
    "llama.down": (4096, 14336), "llama.lm_head": (128256, 4096),
    "qwen3.qkv": (8192, 4096), "qwen3.o": (4096, 4096), "qwen3.gate_up": (24576, 4096),
    "qwen3.down": (4096, 12288), "qwen3.lm_head": (151936, 4096),
}
ROW_PARALLEL = ("o", "down")
TP2_SHAPES = {
    f"{name}.tp2": (n, k // 2) if name.split(".")[1] in ROW_PARALLEL else (n // 2, k)
    for name, (n, k) in MODEL_SHAPES.items()
}
ALL_SHAPES = sorted(set(MODEL_SHAPES.values()) | set(TP2_SHAPES.values()))


def test_gpu_heuristics_are_valid_launch_shapes():
    # The GPU table, checked on any machine: dot tiles >= 16 per dim and within shared memory,
    # elementwise products within ~64 fp32 registers per thread, splits that fill 132 SMs
    # without empty chunks.
    gpu = torch.device("cuda")
    for n, k in ALL_SHAPES:
        for m in (1, 2, 3, 4, 8, 16, 32, 64):
            for dtype in (torch.bfloat16, torch.float32):
                cands = linear_configs.candidate_configs(m, n, k, dtype, gpu, sms=132)
                default = linear_configs.default_config(m, n, k, dtype, gpu, sms=132)
                assert len(cands) == len(set(cands)) >= 4
                for cfg in [default, *cands]:
                    bm = cfg.block_m(m)
                    threads = 32 * cfg.num_warps
                    if cfg.loop == "dot":
                        assert min(bm, cfg.block_n, cfg.block_k) >= 16
                        smem = (cfg.num_stages * (cfg.block_n + bm) * cfg.block_k
                                * dtype.itemsize)
                        assert smem <= 200 * 1024, cfg
                    else:  # the tile is held as fp32: <= 128 registers of it per thread
                        assert m <= 8 and cfg.block_n * cfg.block_k / threads <= 128, cfg
                    num, chunk = linear_configs.plan_splits(k, cfg.block_k, cfg.split_k)
                    assert (num - 1) * chunk < k <= num * chunk
                tiles = -(-n // default.block_n) * linear_configs.plan_splits(
                    k, default.block_k, default.split_k)[0]
                assert tiles >= 132 or default.split_k > 1, (n, k, m, default)


def test_should_use_skinny_and_shape_overrides(monkeypatch):
    assert linear_configs.should_use_skinny(1, 6144, 4096)
    assert linear_configs.should_use_skinny(linear_configs.SKINNY_MAX_M, 6144, 4096)
    assert not linear_configs.should_use_skinny(linear_configs.SKINNY_MAX_M + 1, 6144, 4096)
    assert not linear_configs.should_use_skinny(0, 6144, 4096)
    assert not linear_configs.should_use_skinny(1, 6144, 4100)  # rows not 16-byte aligned
    monkeypatch.setitem(linear_configs.MAX_M_BY_SHAPE, (4096, 4096), 4)
    assert linear_configs.should_use_skinny(4, 4096, 4096)
    assert not linear_configs.should_use_skinny(5, 4096, 4096)
    assert linear_configs.should_use_skinny(8, 6144, 4096) == (8 <= linear_configs.SKINNY_MAX_M)


def test_config_table_roundtrip_and_override(tmp_path, monkeypatch):
    table = linear_configs.ConfigTable()
    cfg = SkinnyConfig(32, 256, 8, 2, split_k=4, loop="ew")
    table.put(3, 4096, 14336, torch.bfloat16, cfg)
    assert table.get(4, 4096, 14336, torch.bfloat16) == cfg  # same M bucket
    assert table.get(5, 4096, 14336, torch.bfloat16) is None
    table.save(tmp_path / "t.json")
    loaded = linear_configs.ConfigTable()
    loaded.load(tmp_path / "t.json")
    assert loaded.entries == table.entries
    monkeypatch.setattr(linear_configs, "TUNED", loaded)
    assert linear_configs.pick_config(4, 4096, 14336, torch.bfloat16, DEVICE) == cfg
    assert linear_configs.pick_config(4, 4096, 14336, torch.float16, DEVICE) != cfg


def test_config_rejects_unknown_loop():
    with pytest.raises(ValueError, match="loop must be"):
        SkinnyConfig(16, 32, 4, 1, 1, "mma")


def test_workspace_refuses_to_grow_during_capture(monkeypatch):
    ws = linear.SplitKWorkspace(DEVICE)
    ws.reserve(64, 4)
    first = ws.partials
    ws.reserve(256, 4)  # grows; the outgrown buffer stays alive for graphs that captured it
    assert ws.partials.numel() >= 256 and any(t is first for t in ws._outgrown)
    monkeypatch.setattr(linear_workspace, "_capturing", lambda device: True)
    ws.reserve(64, 4)  # already large enough: fine
    with pytest.raises(RuntimeError, match="warmup"):
        ws.reserve(1 << 20, 4)


# ----------------------------------------------------------------------------------------------
# GPU only: real shapes, bf16, every candidate config, CUDA-graph capture
# ----------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(DEVICE.type != "cuda", reason="real shapes are too slow interpreted")


def real_case(m: int, n: int, k: int, cfg: SkinnyConfig | None, dtype=torch.bfloat16,
              bias: bool = False) -> float:
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    skinny_linear(x, w, b, out, config=cfg)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    err = ((out.float() - want).norm() / want.norm()).item()
    assert torch.isfinite(out).all() and err < BOUND[dtype], (m, n, k, cfg, err)
    return err


@gpu
@pytest.mark.parametrize("m", [1, 4, 16])
def test_gpu_real_shapes_bf16(m):
    for n, k in ALL_SHAPES:
        real_case(m, n, k, None, bias=n == 8192)


@gpu
@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 32])
def test_gpu_every_candidate_config(m):
    # tune() only times configs, so every one it may pick is checked for correctness here, on
    # a split-prone shape (o_proj) and on ragged N and K (masked K tail, clamped rows).
    dev = DEVICE
    for n, k in [(4096, 4096), (1000, 1000)]:
        for cfg in linear_configs.candidate_configs(m, n, k, torch.bfloat16, dev):
            real_case(m, n, k, cfg)
        for cfg in linear_configs.candidate_configs(m, n, k, torch.float32, dev)[:4]:
            real_case(m, n, k, cfg, dtype=torch.float32)


@gpu
def test_gpu_warmup_then_graph_capture():
    shapes = [(4096, 4096), (6144, 4096), (1000, 1000)]
    linear.warmup(shapes, torch.bfloat16, DEVICE, m_values=(1, 4, 16))
    ws = linear.workspace_for(DEVICE)
    ptrs = (ws.partials.data_ptr(), ws.counters.data_ptr())
    for n, k in shapes:
        for m in (1, 3, 16):
            w = (torch.randn(n, k, device=DEVICE) * k**-0.5).to(torch.bfloat16)
            x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                skinny_linear(x, w, None, out)
            for _ in range(3):
                x.copy_(torch.randn(m, k, device=DEVICE))
                graph.replay()
                want = F.linear(x.float(), w.float())
                err = ((out.float() - want).norm() / want.norm()).item()
                assert err < BOUND[torch.bfloat16], (m, n, k, err)
    assert (ws.partials.data_ptr(), ws.counters.data_ptr()) == ptrs, "workspace grew in capture"
    assert int(ws.counters.sum()) == 0


def test_bundled_h200_table_loads(monkeypatch):
    """The shipped tuned table parses into configs for every 8B decode linear at M = 1."""
    table = linear_configs.ConfigTable()
    table.load(linear_configs.BUNDLED_CONFIGS / "skinny_linear_nvidia_h200.json")
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        assert table.get(1, n, k, torch.bfloat16) is not None


def test_bundled_h100_table_loads_and_is_found_by_the_card_name(monkeypatch):
    """The H100's table (W8A8 16-64 rows) parses, and the card's name finds it."""
    monkeypatch.setattr(linear_configs, "TUNED", linear_configs.ConfigTable())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    path = linear_configs.load_bundled_configs(torch.device("cuda", 0))
    assert path is not None and path.name == "skinny_linear_nvidia_h100_80gb_hbm3.json"
    for m in (16, 32, 64):
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
            cfg = linear_configs.TUNED.get(m, n, k, torch.float8_e4m3fn, True)
            assert cfg is not None and cfg.loop == "dot", (m, n, k)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,n,k", [(1, 17, 64), (3, 256, 100), (8, 17, 512), (16, 33, 128),
                                   (100, 33, 64)])
def test_fp8_weight_matches_dequantized_reference(variant, m, n, k):
    """An FP8 weight with its row scales (bf16 x, no activation rounding) = F.linear on the
    dequantized weight in fp32, to bf16's output rounding; the scale is applied per row."""
    if not serves(variant, m):
        pytest.skip("the ew loop serves M <= 8")
    from phaseflip.model.quant.fp8 import quantize_rows

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w_q, scale = quantize_rows(torch.randn(n, k, generator=gen) * 3)
    w_q, scale = w_q.to(DEVICE), scale.to(DEVICE).float().reshape(n)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16)
    got = skinny_linear(x, w_q, b, weight_scale=scale, config=VARIANTS[variant])
    want = F.linear(x.float(), w_q.float() * scale[:, None], b.float())
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def test_fp8_weight_needs_its_scale():
    w_q = torch.zeros(16, 32, device=DEVICE).to(torch.float8_e4m3fn)
    x = torch.zeros(1, 32, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="FP8 weight"):
        skinny_linear(x, w_q)
    with pytest.raises(ValueError, match="FP8 weight"):
        skinny_linear(x.float(), w_q, weight_scale=torch.ones(16, device=DEVICE))


def _w8a8_operands(m: int, n: int, k: int, seed: int = 11):
    """Per-token FP8 x and per-row FP8 W (as `model.quant.fp8` makes them), and the float32
    product of those FP8 values with both scales: what the W8A8 loop must return."""
    from phaseflip.model.quant.fp8 import quantize_rows, quantize_tokens

    gen = torch.Generator().manual_seed(seed)
    x_q, sx = quantize_tokens(torch.randn(m, k, generator=gen))
    w_q, sw = quantize_rows(torch.randn(n, k, generator=gen) * 3)
    b = torch.randn(n, generator=gen).to(torch.bfloat16)
    want = (x_q.float() @ w_q.float().t()) * sx * sw[None, :] + b.float()
    return x_q.to(DEVICE), sx.to(DEVICE), w_q.to(DEVICE), sw.to(DEVICE), b.to(DEVICE), want


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("m,n,k", [(1, 17, 64), (3, 256, 100), (8, 17, 512), (16, 33, 128),
                                   (100, 33, 64)])
def test_w8a8_matches_fp8_product(variant, m, n, k):
    """FP8 x (per-token scales) times an FP8 weight (row scales) = the float32 product of the
    same FP8 values, scaled by both, to bf16's output rounding; every loop, split or not.
    Red if either scale is dropped or applied along the wrong axis."""
    if not serves(variant, m):
        pytest.skip("the ew loop serves M <= 8")
    x_q, sx, w_q, sw, b, want = _w8a8_operands(m, n, k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = skinny_linear(x_q, w_q, b, out, weight_scale=sw, x_scale=sx,
                        out_dtype=torch.bfloat16, config=VARIANTS[variant])
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    err = ((got.float().cpu() - want).norm() / want.norm()).item()
    assert err < 1e-2, f"relative error {err:.3g} ({variant})"


def test_w8a8_operand_rules():
    x_q, sx, w_q, sw, b, _ = _w8a8_operands(2, 16, 32)
    bf16 = torch.bfloat16
    with pytest.raises(ValueError, match="FP8 x needs an FP8 weight"):
        skinny_linear(x_q, w_q, weight_scale=sw, out_dtype=bf16)  # no x_scale
    with pytest.raises(ValueError, match="FP8 x needs an FP8 weight"):
        skinny_linear(x_q, w_q, weight_scale=sw, x_scale=sx[:1], out_dtype=bf16)
    with pytest.raises(ValueError, match="FP8 x needs an FP8 weight"):  # x_scale, 16-bit x
        skinny_linear(x_q.to(bf16), w_q, weight_scale=sw, x_scale=sx)
    with pytest.raises(ValueError, match="float out_dtype"):
        skinny_linear(x_q, w_q, weight_scale=sw, x_scale=sx)
    with pytest.raises(ValueError, match="float out_dtype"):
        skinny_linear(x_q, w_q, weight_scale=sw, x_scale=sx, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="bias must be"):
        skinny_linear(x_q, w_q, b.float(), weight_scale=sw, x_scale=sx, out_dtype=bf16)
    with pytest.raises(ValueError, match="out must be"):
        skinny_linear(x_q, w_q, None, torch.empty(2, 16, device=DEVICE), weight_scale=sw,
                      x_scale=sx, out_dtype=bf16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 16, 128])
def test_fp8_linear_routes_few_rows_to_w8a8(monkeypatch, m, dtype):
    """`scaled_linear` on a few rows (a GPU with FP8 MMAs simulated on the interpreter): past
    `FP8_WEIGHT_ONLY_MAX_M` rows, quantized per token, then the skinny kernel's W8A8 loop,
    which agrees with the float32 reference of the same FP8 values (`scaled_linear_ref`) to
    accumulation order; a producer's `Fp8Activation` takes the same kernel. Up to it, 16-bit
    rows go weight-only. A float32 model's rows are quantized alike and come back float32
    (16-bit rows only go weight-only). Red if the routing or the W8A8 scales break."""
    from phaseflip.model.quant import fp8

    most = fp8.FP8_SKINNY_MAX_M  # (the real rule also asks for CUDA)
    monkeypatch.setattr(fp8, "skinny_rows", lambda x, w: x.numel() // x.shape[-1] <= most)
    monkeypatch.setattr(fp8, "_fp8_mma", lambda index: True)
    monkeypatch.setattr(fp8, "_quantize_on_gpu", fp8.quantize_tokens)
    launched = []
    real = linear.skinny_linear
    monkeypatch.setattr(linear, "skinny_linear",
                        lambda *a, **kw: launched.append(kw.get("x_scale")) or real(*a, **kw))
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(m, 96, generator=gen) * 4).to(dtype)
    w_q, sw = fp8.quantize_rows(torch.randn(48, 96, generator=gen))
    want = fp8.scaled_linear_ref(x, w_q, sw).float()
    weight_only = m <= fp8.FP8_WEIGHT_ONLY_MAX_M and dtype != torch.float32
    if weight_only:  # no activation rounding: the dequantized weight's product
        want = (x.float() @ (w_q.float() * sw[:, None]).t())
    for arg in (x.to(DEVICE), fp8.Fp8Activation(*fp8.quantize_tokens(x.to(DEVICE)), x.dtype)):
        got = fp8.scaled_linear(arg, w_q.to(DEVICE), sw.to(DEVICE))
        assert got.dtype == dtype
        got = got.float().cpu()
        if not (weight_only and isinstance(arg, fp8.Fp8Activation)):
            assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert len(launched) == 2 and (launched[0] is None) == weight_only
    assert launched[1] is not None  # quantized rows always take the W8A8 loop


def test_fp8_rows_past_16_take_the_skinny_kernel_only_where_tuned(monkeypatch):
    """Up to 16 rows every FP8 shape takes the skinny kernel; from 17 to 128 only a shape with a
    tuned W8A8 entry for that M bucket on a GPU with FP8 MMAs (an untuned 128-row tile may not
    fit a smaller GPU's shared memory, or beat cuBLAS); never past 128. Red if the routing
    ignores the table or the MMA check."""
    from types import SimpleNamespace

    from phaseflip.model.quant import fp8

    def rows(m: int, k: int = 64):  # a CUDA activation as `skinny_rows` reads one
        return SimpleNamespace(is_cuda=True, shape=(m, k), numel=lambda: m * k,
                               device=SimpleNamespace(index=0))

    tuned = torch.empty(48, 64, dtype=torch.float8_e4m3fn, device="meta")
    other = torch.empty(32, 64, dtype=torch.float8_e4m3fn, device="meta")
    monkeypatch.setattr(fp8, "_HAS_TRITON", True)
    monkeypatch.setattr(fp8, "_fp8_mma", lambda index: True)
    monkeypatch.setattr(linear_configs.TUNED, "entries", {})
    linear_configs.TUNED.put(64, 48, 64, torch.float8_e4m3fn, linear_configs.SkinnyConfig(
        64, 128, 4, 4, 1, "dot"), w8a8=True)  # the bucket of 33..64 rows
    assert fp8.skinny_rows(rows(16), other) and fp8.skinny_rows(rows(16), tuned)
    assert fp8.skinny_rows(rows(40), tuned) and not fp8.skinny_rows(rows(40), other)
    assert not fp8.skinny_rows(rows(100), tuned)  # (its bucket, 128, is not tuned)
    assert not fp8.skinny_rows(rows(40, k=72), tuned)  # K not a multiple of 16
    monkeypatch.setattr(fp8, "_fp8_mma", lambda index: False)
    assert fp8.skinny_rows(rows(16), tuned) and not fp8.skinny_rows(rows(40), tuned)
