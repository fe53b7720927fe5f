"""`benchmarks.gpu_gaps`: idle gaps between kernels, each blamed on the host event spanning it."""

from types import SimpleNamespace

import torch

from benchmarks.gpu_gaps import gap_report

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _ev(name: str, start: float, end: float, device=CPU) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=device,
                           time_range=SimpleNamespace(start=start, end=end))


def _prof(events: list) -> SimpleNamespace:
    return SimpleNamespace(events=lambda: events, key_averages=lambda: [])


def test_long_gaps_are_blamed_on_the_innermost_host_phase_and_op():
    events = [
        _ev("k1", 0, 100, CUDA), _ev("k2", 105, 200, CUDA),   # 5 µs: a short gap
        _ev("k3", 150, 210, CUDA),                             # overlaps k2: merged
        _ev("k4", 1210, 1300, CUDA),                           # 1 000 µs idle before it
        _ev("phase:step", 0, 2000), _ev("phase:sample", 300, 1500),
        _ev("cudaStreamSynchronize", 400, 1400), _ev("aten::argmax", 250, 290),
        _ev("phase:step", 0, 0, CUDA),                         # a range's GPU span: ignored
    ]
    r = gap_report(_prof(events), steps=2, min_us=20)
    assert r["long_gaps"] == 1
    assert r["short_gap_ms_per_step"] == 0.005 / 2
    assert r["long_gap_ms_per_step"] == 1.0 / 2
    assert r["blame_ms_per_step"] == {"sample / cudaStreamSynchronize": 0.5}
    assert r["longest"][0]["at_ms"] == 0.21 and r["longest"][0]["ms"] == 1.0


def test_no_kernels_means_no_gaps():
    r = gap_report(_prof([_ev("phase:step", 0, 10)]), steps=1)
    assert r == {"idle_ms_per_step": 0.0, "long_gaps": 0}
