"""benchmarks.gpu_busy: NVML busy per GPU from outside the ranks, on the CPU with a fake
nvidia-smi (a script first on PATH that prints known lines at the period it is asked for)."""

from __future__ import annotations

import os
import sys
import time
import types

import pytest

from benchmarks import gpu_busy
from benchmarks.gpu_busy import GpuBusySampler, Sample, busy_summary, parse_smi_line, visible_ids
from phaseflip.config import EMBEDDED_MODEL

FAKE_SMI = """#!{python}
import os, signal, sys, time
args = sys.argv[1:]
open(os.environ["FAKE_SMI_LOG"], "w").write(str(os.getpid()) + "\\n" + " ".join(args))
mode = os.environ.get("FAKE_SMI_MODE", "ok")
if mode == "fail":
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    sys.exit(9)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
period = int(args[args.index("-lms") + 1]) / 1000
n = 0
while True:
    t = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + ".%03d" % (int(t * 1000) % 1000)
    values = {{0: "95", 1: ("50" if n % 2 else "70"), 2: "10"}}
    for i, v in values.items():
        print(f"{{stamp}}, {{i}}, GPU-fake{{i}}-uuid, {{'[N/A]' if mode == 'na' else v}}",
              flush=True)
    n += 1
    time.sleep(period)
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """A fake nvidia-smi first on PATH, pynvml hidden; returns the file its pid and args go to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable))
    smi.chmod(0o755)
    log = tmp_path / "smi.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SMI_LOG", str(log))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    return log


def _wait_for(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_parse_smi_line_and_visible_devices():
    t, index, uuid, pct = parse_smi_line("2026/12/02 07:20:01.250, 1, GPU-ab12, 97\n", 0.0)
    assert (index, uuid, pct) == ("1", "GPU-ab12", 97.0)
    assert t == pytest.approx(time.mktime(time.strptime("2026/12/02 07:20:01",
                                                        "%Y/%m/%d %H:%M:%S")) + 0.25)
    assert parse_smi_line("2026/12/02 07:20:01.250, 1, GPU-ab12, [N/A]", 0.0) is None
    assert parse_smi_line("NVIDIA-SMI has failed", 0.0) is None
    assert parse_smi_line("garbled, 0, GPU-x, 40", 5.0)[0] == 5.0  # dated when read
    assert visible_ids([0, 1], None) == ["0", "1"]
    assert visible_ids([0, 1], "3,1") == ["3", "1"]
    assert visible_ids([1], "GPU-aa, GPU-bb") == ["GPU-bb"]
    with pytest.raises(ValueError):
        visible_ids([2], "3,1")


def test_summary_stats_window_and_bubble():
    w0 = 1000.0
    samples = [Sample(w0 + 0.05, "0", 10.0)]  # inside the settle time: dropped
    samples += [Sample(w0 + 0.2 + 0.1 * k, "0", v) for k, v in enumerate([100, 90, 80, 90, 90])]
    samples += [Sample(w0 + 0.3, "1", 50.0), Sample(w0 + 5.0, "1", 60.0)]  # 1 in the window
    s = busy_summary(samples, {"0": [0], "1": [1]}, [(w0, w0 + 1.0)], 0.010,
                     source="nvidia-smi", period_s=0.1)
    d0, d1 = s["devices"]
    assert (d0["samples"], d0["mean_pct"], d0["min_pct"]) == (5, 90.0, 80.0)
    assert d0["p10_pct"] == pytest.approx(84.0)
    assert d0["host_bubble_ms_per_step"] == pytest.approx(1.0)  # (1 - 0.9) x 10 ms
    assert d0["series"] == [[0.2, 100], [0.3, 90], [0.4, 80], [0.5, 90], [0.6, 90]]  # when
    assert d1["mean_pct"] is None and d1["samples"] == 0  # 1 < MIN_SAMPLES: unmeasured
    assert d1["series"] == []
    assert "1: 1 sample(s)" in s["note"]
    assert s["host_bubble_ms_per_step"] == pytest.approx(1.0) and s["step_ms"] == 10.0
    no_step = busy_summary(samples, {"0": [0]}, [(w0, w0 + 1.0)], None, source="x",
                           period_s=0.1)
    assert no_step["devices"][0]["mean_pct"] == 90.0 and no_step["host_bubble_ms_per_step"] is None


def test_cpu_and_no_tool_are_unmeasured(tmp_path, monkeypatch):
    with GpuBusySampler(None, note="the engine is not on a GPU") as cpu:
        pass
    s = cpu.summary(step_s=0.01)
    assert s["devices"] is None and s["host_bubble_ms_per_step"] is None
    assert s["source"] is None and s["note"] == "the engine is not on a GPU"
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with GpuBusySampler({"0": [0]}) as none:
        time.sleep(0.05)
    s = none.summary(step_s=0.01)
    assert s["devices"][0]["mean_pct"] is None and s["host_bubble_ms_per_step"] is None
    assert "neither pynvml nor nvidia-smi" in s["note"]


@pytest.mark.timeout(60)
def test_fake_smi_is_parsed_mapped_and_cleaned_up(fake_smi):
    gpus = {"0": [0], "GPU-fake2": [1, 2]}  # an index, and a UUID holding two ranks
    with GpuBusySampler(gpus, period_s=0.02) as sampler:
        assert _wait_for(lambda: sum(s.device == "GPU-fake2" for s in sampler.samples) >= 25)
    pid_line, args = fake_smi.read_text().splitlines()
    assert "-lms 20" in args and f"--query-gpu={gpu_busy.SMI_QUERY}" in args
    assert sampler.pid == int(pid_line) and _gone(sampler.pid)  # no orphan left behind
    assert {s.device for s in sampler.samples} == set(gpus)  # GPU 1 is not ours
    s = sampler.summary(step_s=0.008)
    assert s["source"] == "nvidia-smi" and s["note"] is None
    d0, d2 = s["devices"]
    assert (d0["mean_pct"], d0["min_pct"], d0["p10_pct"]) == (95.0, 95.0, 95.0)
    assert d0["samples"] >= gpu_busy.MIN_SAMPLES and d2["ranks"] == [1, 2]
    assert d2["mean_pct"] == 10.0
    assert d0["host_bubble_ms_per_step"] == pytest.approx(0.4)  # (1 - 0.95) x 8 ms
    assert s["host_bubble_ms_per_step"] == pytest.approx(7.2)  # the worst GPU's


@pytest.mark.timeout(60)
def test_alternating_values_give_mean_min_p10(fake_smi):
    with GpuBusySampler({"1": [0]}, period_s=0.02) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 30)
    d = sampler.summary()["devices"][0]
    assert d["min_pct"] == 50.0 and d["p10_pct"] == 50.0 and 55.0 <= d["mean_pct"] <= 65.0


@pytest.mark.timeout(60)
def test_a_child_that_ignores_sigterm_is_killed(fake_smi, monkeypatch):
    monkeypatch.setenv("FAKE_SMI_MODE", "stubborn")
    monkeypatch.setattr(gpu_busy, "STOP_TIMEOUT_S", 0.5)
    with GpuBusySampler({"0": [0]}, period_s=0.02) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 3)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3.0
    assert _gone(sampler.pid)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["fail", "na"])
def test_a_failing_or_unsupported_smi_is_a_note(fake_smi, monkeypatch, mode):
    monkeypatch.setenv("FAKE_SMI_MODE", mode)
    with GpuBusySampler({"0": [0]}, period_s=0.02) as sampler:
        if mode == "fail":  # it exits on its own: the note comes from the reader thread
            assert _wait_for(lambda: "stopped early" in (sampler.summary()["note"] or ""))
        else:
            time.sleep(0.4)
    s = sampler.summary(step_s=0.01)
    assert s["devices"][0]["mean_pct"] is None and s["host_bubble_ms_per_step"] is None
    assert _gone(sampler.pid)
    if mode == "fail":
        assert "stopped early (exit 9)" in s["note"] and "failed" in s["note"]
    else:
        assert "0 sample(s)" in s["note"]


def test_pynvml_backend(monkeypatch):
    calls: list[str] = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda u: ("uuid", u),
        nvmlDeviceGetHandleByIndex=lambda i: ("index", i),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(
            gpu=99 if h == ("index", 3) else 40))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with GpuBusySampler({"3": [0], "GPU-x": [1]}, period_s=0.01) as sampler:
        assert _wait_for(lambda: len(sampler.samples) >= 80)  # 0.4 s
    assert calls == ["init", "shutdown"] and sampler.pid is None
    d3, dx = sampler.summary(step_s=0.01)["devices"]
    assert (d3["mean_pct"], dx["mean_pct"]) == (99.0, 40.0)


def test_a_sampler_that_cannot_start_does_not_fail_the_block(monkeypatch):
    def boom(self):
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(GpuBusySampler, "_start", boom)
    ran = False
    with GpuBusySampler({"0": [0]}) as sampler:
        ran = True
    assert ran and "NVML exploded" in sampler.summary(step_s=0.01)["note"]


@pytest.mark.timeout(180)
def test_benchmarks_survive_a_failing_sampler(monkeypatch):
    """The CPU engine is told it runs on GPU 0; sampling fails: both benchmarks complete,
    their JSON says gpu_busy is unmeasured and why."""
    from benchmarks import bench_latency, bench_offline

    def boom(self):
        raise RuntimeError("NVML exploded")

    monkeypatch.setattr(GpuBusySampler, "_start", boom)
    monkeypatch.setattr(gpu_busy, "engine_gpus", lambda engine: {"0": [0]})
    model = str(EMBEDDED_MODEL)
    lat = bench_latency.main(["--model", model, "--device", "cpu", "--batch-sizes", "1",
                              "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                              "--num-warmup", "0"])
    (row,) = lat["results"]
    assert row["decode_step_s"]["n"] == 3
    assert row["host_bubble_ms_per_step"] is None and row["gpu_busy"]["devices"][0]["device"] == "0"
    assert "NVML exploded" in row["gpu_busy"]["note"]
    off = bench_offline.main(["--model", model, "--device", "cpu", "--num-prompts", "2",
                              "--dataset", "fixed", "--input-len", "4", "--output-len", "3",
                              "--num-warmup", "0"])
    assert off["phaseflip"]["output_tokens"] == 6 and off["engine_steps"] >= 3
    assert off["host_bubble_ms_per_step"] is None and "NVML exploded" in off["gpu_busy"]["note"]
    off = bench_offline.main(["--model", model, "--device", "cpu", "--num-prompts", "2",
                              "--dataset", "fixed", "--input-len", "4", "--output-len", "3",
                              "--num-warmup", "0", "--gpu-busy", "off"])
    assert off["gpu_busy"]["note"] == "--gpu-busy off" and off["gpu_busy"]["devices"] is None


def test_engine_gpus_places_ranks_like_rank_device(monkeypatch):
    import torch

    def engine(device: torch.device, world: int, nnodes: int = 1) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            core=types.SimpleNamespace(runner=types.SimpleNamespace(device=device)),
            config=types.SimpleNamespace(world_size=world, nnodes=nnodes))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid=f"u{i}"))
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert gpu_busy.engine_gpus(engine(cuda0, 4)) == {"GPU-u0": [0, 2], "GPU-u1": [1, 3]}
    assert gpu_busy.engine_gpus(engine(cuda1, 1)) == {"GPU-u1": [0]}
    assert gpu_busy.engine_gpus(engine(cuda0, 4, nnodes=2)) == {"GPU-u0": [0], "GPU-u1": [1]}
    assert gpu_busy.engine_gpus(engine(torch.device("cpu"), 1)) is None

    def no_uuid(i: int):
        raise AttributeError("uuid")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_uuid)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert gpu_busy.engine_gpus(engine(cuda0, 2)) == {"5": [0], "7": [1]}
