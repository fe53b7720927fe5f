"""The communication benchmark end to end on two gloo ranks on the CPU.

A deadline (pytest-timeout, thread method: signals cannot interrupt gloo) turns a deadlock
between the ranks into a failure instead of a hung run.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import bench_comm


@pytest.mark.timeout(120, method="thread")
def test_every_op_and_size_has_a_finite_time(tmp_path):
    out = tmp_path / "comm.json"
    bench_comm.main(["--device", "cpu", "--backend", "gloo", "--world-size", "2",
                     "--sizes", "8K,64K", "--iters", "2", "--warmup", "1", "--ops-per-iter", "2",
                     "--deadline-s", "90", "--out", str(out)])
    data = json.loads(out.read_text())
    assert (data["world_size"], data["backend"], data["dtype"]) == (2, "gloo", "bfloat16")
    assert data["env"]["commit"] and data["nccl_version"] is None
    assert data["cuda_graph_error"] == "CUDA only"
    rows = {(r["op"], r["size_bytes"]): r for r in data["rows"]}
    assert set(rows) == {(op, size) for op in bench_comm.CASES for size in (8 << 10, 64 << 10)}
    for (op, size), r in rows.items():
        assert 0 < r["time_us"] and math.isfinite(r["time_us"]), (op, size)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
    assert rows[("all_reduce", 8192)]["bytes"] == 8192
    assert rows[("all_gather", 8192)]["bytes"] == 8192  # the output: two 4 KiB halves
    assert rows[("all_reduce", 8192)]["busbw_GBps"] == pytest.approx(
        rows[("all_reduce", 8192)]["algbw_GBps"])  # 2(n-1)/n = 1 at n = 2


@pytest.mark.timeout(60, method="thread")
def test_deadline_kills_the_ranks():
    with pytest.raises(bench_comm.CommBenchError, match="deadline"):
        bench_comm.main(["--device", "cpu", "--backend", "gloo", "--sizes", "8K",
                         "--deadline-s", "0.01"])


@pytest.mark.parametrize("text, size, shown", [
    ("8K", 8192, "8 KiB"), ("2M", 2 << 20, "2 MiB"), ("1G", 1 << 30, "1 GiB"),
    ("512KiB", 512 << 10, "512 KiB"), ("100", 100, "100 B"), ("1536K", 1536 << 10, "1536 KiB"),
])
def test_sizes_are_binary_units(text, size, shown):
    assert bench_comm.parse_size(text) == size
    assert bench_comm.format_size(size) == shown
