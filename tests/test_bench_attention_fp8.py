"""benchmarks/attention_kernels.py on an FP8 pool, shrunk to a CPU-sized head layout and run
through the Triton interpreter with a stand-in timer: every FP8 sweep candidate launches and
matches the reference, the pool is calibrated per KV head, and the bandwidth counts FP8 bytes.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from triton_interpreter import interpret_without_cuda

interpret_without_cuda()  # before triton is imported
pytest.importorskip("triton")

from benchmarks import attention_kernels as bench_attn  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(bench_attn, "HEADS", 8)
    monkeypatch.setattr(bench_attn, "KV_HEADS", 2)
    monkeypatch.setattr(bench_attn, "HEAD_DIM", 32)
    calls = []

    def fake_bench(fn, quick: bool) -> float:  # one real launch; a fixed 0.5 ms
        fn()
        calls.append(quick)
        return 0.5

    monkeypatch.setattr(bench_attn, "bench", fake_bench)
    return argparse.Namespace(page_size=4, quick=True, sweep=True, bw_ceiling=4.2,
                              flops_ceiling=780.0)


def test_fp8_decode_case_sweeps_every_fp8_candidate(small):
    gen = torch.Generator().manual_seed(0)
    fp8 = torch.float8_e4m3fn
    row = bench_attn.run_case("decode", [(129, 1), (60, 1)], fp8, small, DEVICE, gen)
    assert row["kv_dtype"] == "float8_e4m3fn" and row["rel_err"] < 1e-2
    assert row["decode_config"].endswith("_" + bench_attn.kernels.FP8_DECODE_DOT)
    names = {bench_attn.config_name(c, True) for c in bench_attn.DECODE_SWEEP_FP8}
    assert names <= set(row["sweep_kernel_us"]) and "n64_w4_s3_q" in names
    assert "m64_n64_w4_s3_fp16" in names  # the warpgroup-MMA candidates
    assert set(row["sweep_rel_err"]) == set(row["sweep_kernel_us"])
    assert max(row["sweep_rel_err"].values()) < 1e-2  # every candidate's output is right
    kv_bytes = 2 * row["kv_tokens"] * 2 * 32 * 1  # K and V, one byte a value
    assert row["kv_read_GBps"] == pytest.approx(kv_bytes / 0.5e-3 / 1e9)
    assert row["sweep_TBps"]["n64_w4_s3_q"] == pytest.approx(kv_bytes / 0.5e-3 / 1e12)


def test_fp8_pool_is_calibrated_per_kv_head_extend_and_bf16_run(small):
    pool = bench_attn.make_pool(64, torch.float8_e4m3fn, DEVICE)
    assert not torch.equal(pool.k_scale[0], torch.ones_like(pool.k_scale[0]))
    kk, _ = pool.dequantized(0, torch.arange(64, device=DEVICE))
    peak = pool.k[0].float().abs().amax((0, 2))  # each head's largest row value hits 448
    assert torch.equal(peak, torch.full_like(peak, 448.0)) and kk.std() > 0.5
    gen = torch.Generator().manual_seed(1)
    row = bench_attn.run_case("extend", [(20, 9)], torch.float8_e4m3fn, small, DEVICE, gen)
    assert row["rel_err"] < 1e-2 and row["decode_config"] is None and "TFLOPs" in row
    names = {bench_attn.config_name(c, True, 0) for c in bench_attn.EXTEND_SWEEP_FP8}
    assert names == set(row["sweep_rel_err"]) and "m64_n64_w4_s3_fp16" in names
    assert max(row["sweep_rel_err"].values()) < 1e-2
    small.sweep = False
    row = bench_attn.run_case("decode", [(40, 1)], torch.bfloat16, small, DEVICE, gen)
    assert row["kv_dtype"] == "bfloat16" and row["rel_err"] < 1e-2
    assert row["kv_read_GBps"] == pytest.approx(2 * 41 * 2 * 32 * 2 / 0.5e-3 / 1e9)


def test_fp8_summary_pairs_each_case(small, capsys):
    gen = torch.Generator().manual_seed(2)
    rows = [bench_attn.run_case("decode", [(50, 1)], kv, small, DEVICE, gen)
            for kv in (torch.bfloat16, torch.float8_e4m3fn)]
    bench_attn.print_fp8_summary(rows)
    line = capsys.readouterr().out.strip()
    assert line.startswith("decode") and "1.00x bf16" in line and "best fp8 " in line
