"""`benchmarks/profile_mixed_step` on the tiny bundled model, on CPU (a smoke run: the script
runs end to end and writes every figure the lead reads off the H200 run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from phaseflip.config import EMBEDDED_MODEL

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

ROW_KEYS = {"mixed_decode", "prompt_len", "mixed_step_ms", "forward_host_ms", "ttft_ms",
            "bg_gap_max_ms", "decode_step_ms", "steps_to_first_token", "prompt_step_kinds",
            "client_passes", "synced_passes", "profile"}
PROFILE_KEYS = {"kind", "wall_ms_profiled", "kernel_ms", "kernel_launches", "launches_per_layer",
                "memcpy_memset", "launch_api_calls", "launch_api_ms", "host_ms", "num_layers",
                "gpu_idle_ms", "top_kernels_ms"}


@pytest.mark.timeout(60, method="thread")
def test_profile_mixed_step_smoke(tmp_path):
    from benchmarks import profile_mixed_step

    out = tmp_path / "mixed.json"
    data = profile_mixed_step.main([
        "--model", str(EMBEDDED_MODEL), "--device", "cpu", "--decodes", "2", "--context", "16",
        "--prompt-lens", "8,16", "--repeats", "1", "--decode-steps", "2", "--cprofile-top", "5",
        "--out", str(out)])
    on_disk = json.loads(out.read_text())
    assert on_disk["benchmark"] == "profile_mixed_step" and "env" in on_disk
    # the torch reference backend has no mixed_decode switch: one run, both settings skipped
    assert data["mixed_decode_settings"] == ["n/a"]
    assert data["mixed_decode_skipped"] == ["on", "off"]
    rows = data["rows"]
    assert [r["prompt_len"] for r in rows] == [8, 16]
    for r in rows:
        assert ROW_KEYS <= set(r) and PROFILE_KEYS <= set(r["profile"])
        # every new prompt was one step that also carried the two decodes
        assert r["prompt_step_kinds"] == [["mixed"]] and r["profile"]["kind"] == "mixed"
        assert r["mixed_step_ms"]["p50"] > 0 and r["decode_step_ms"]["p50"] > 0
        # the forward is part of the step (on the CPU nothing runs behind the host's back)
        assert 0 < r["forward_host_ms"]["p50"] <= r["mixed_step_ms"]["p50"]
        # overlapped: the mixed step's token reaches the client in the step after it
        assert r["steps_to_first_token"] == [2]
        assert r["ttft_ms"]["p50"] > 0 and r["bg_gap_max_ms"]["p50"] > 0
        assert r["profile"]["num_layers"] == 4
    top = data["cprofile"]["top"]
    assert data["cprofile"]["prompt_len"] == 16 and 0 < len(top) <= 5
    assert {"function", "calls", "tottime_ms", "cumtime_ms"} <= set(top[0])


def test_mixed_decode_switch_applied():
    """A backend with the switch runs the settings asked for, each applied before its run."""
    from benchmarks.profile_mixed_step import _apply, _settings

    backend = SimpleNamespace(mixed_decode=True)
    bench = SimpleNamespace(core=SimpleNamespace(runner=SimpleNamespace(backend=backend)))
    settings, skipped, found = _settings(bench, ["on", "off"])
    assert (settings, skipped, found) == (["on", "off"], [], backend)
    _apply(found, "off")
    assert backend.mixed_decode is False
    _apply(found, "on")
    assert backend.mixed_decode is True


def test_launch_counts_classifies_device_events():
    """Kernels and copies are told apart on the device side, the launch API on the host's
    (Triton launches through the driver's cuLaunchKernel, torch through the runtime's)."""
    import torch

    from benchmarks.profile_mixed_step import launch_counts

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, device, cpu_us=0.0):
        return SimpleNamespace(name=name, device_type=device, cpu_time_total=cpu_us)

    events = [ev("_extend_kernel", cuda), ev("_decode_split_kernel", cuda),
              ev("Memcpy HtoD (Pinned -> Device)", cuda), ev("Memset (Device)", cuda),
              ev("phase:step", cuda), ev("cuLaunchKernel", cpu, 30.0),
              ev("cudaLaunchKernel", cpu, 10.0), ev("aten::mm", cpu, 50.0)]
    counts = launch_counts(SimpleNamespace(events=lambda: events))
    assert counts == {"kernel_launches": 2, "memcpy_memset": 2, "launch_api_calls": 2,
                      "launch_api_ms": pytest.approx(0.04)}
