"""`benchmarks/bench_host_step.py` end to end on the CPU: one process and a two-rank layout of
each kind run the real engine step with a null forward, and every row reports what it says
(a full decode batch held through the window, the other ranks' CPU, a round time)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(240, method="thread")


def test_host_step_runs_every_layout(tmp_path, monkeypatch):
    import torch

    from benchmarks import bench_host_step
    from phaseflip.distributed.stage import NULL_FORWARD_ENV

    # the benchmark sets both for the ranks it spawns: undone after, for the other tests
    monkeypatch.setenv(NULL_FORWARD_ENV, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    out = tmp_path / "host_step.json"
    try:
        data = bench_host_step.main(["--layouts", "tp1,tp2,pp2", "--num-requests", "3",
                                     "--steps", "6", "--warmup-steps", "2", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert out.exists()
    rows = {r["layout"]: r for r in data["results"]}
    assert set(rows) == {"tp1", "tp2", "pp2"}
    for lay, r in rows.items():
        assert r["num_requests"] == 3 and r["driver_wall_ms"]["n"] == 6
        assert r["driver_wall_ms"]["p50"] > 0 and r["round_ms"] > 0
        assert 0 < r["driver_thread_cpu_ms"]["p50"] and r["driver_thread_cpu_ms"]["n"] == 6
        assert r["driver_preempted_per_step"] >= 0 and r["driver_slept_per_step"] >= 0
        assert len(r["worker_cpu_ms_per_step"]) == (0 if lay == "tp1" else 1)
