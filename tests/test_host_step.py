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


def test_host_step_breakdown_times_the_parts_a_layout_has(tmp_path, monkeypatch):
    """--breakdown times the parts of the driver's step: pp2 has a plan to encode and send and
    the last stage's ids to wait for, and chooses no greedy token itself; one process has no
    plan to send (left out, not reported as 0)."""
    import torch

    from benchmarks import bench_host_step
    from phaseflip.distributed.stage import NULL_FORWARD_ENV

    monkeypatch.setenv(NULL_FORWARD_ENV, "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    try:
        data = bench_host_step.main(["--layouts", "tp1,pp2", "--num-requests", "3",
                                     "--steps", "6", "--warmup-steps", "2", "--breakdown"])
    finally:
        torch.set_num_threads(threads)
    parts = {r["layout"]: r["step_parts_ms_p50"] for r in data["results"]}
    ranks_only = {"launch: plan encode", "launch: plan to ranks", "wait for logits"}
    assert ranks_only <= set(parts["pp2"]) and not ranks_only & set(parts["tp1"])
    for p in parts.values():
        assert {"schedule", "launch"} <= set(p) and all(v >= 0 for v in p.values())
    assert parts["tp1"]["sample: choose"] > 0  # pp2's greedy rows: the last stage chose
    assert "sample: choose" not in parts["pp2"]  # them (`sampling/last_stage.py`)
