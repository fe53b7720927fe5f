"""Where the GPU waited: idle gaps between kernels in a torch.profiler window, each blamed on
what the host was doing at the time.

A step's wall time past its kernel time is either many tiny launch gaps or a few long waits
for the host (a sync, a cudaFree, Python work the overlap did not hide). The kernel sum alone
cannot tell them apart; the gaps' sizes and the host events spanning them can. Used by
`profile_decode` and `profile_offline` (their `--gaps`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

CUDA = torch.autograd.DeviceType.CUDA


def _gpu_intervals(events: list[Any]) -> list[tuple[float, float]]:
    """Merged busy intervals (µs) of the device's kernels, copies and memsets."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == CUDA and not e.name.startswith("phase:"))
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _innermost(cpu: list[Any], t: float, phases: bool) -> str:
    """Name of the shortest host event (a `phase:` range, or any other op) spanning time t."""
    best, best_len = "-", float("inf")
    for e in cpu:
        if e.name.startswith("phase:") != phases:
            continue
        s, f = e.time_range.start, e.time_range.end
        if s <= t <= f and f - s < best_len:
            best, best_len = e.name.removeprefix("phase:"), f - s
    return best


def gap_report(prof: Any, steps: int, min_us: float = 20.0, top: int = 10) -> dict[str, Any]:
    """GPU idle time per step inside the window (first kernel to last), split into gaps below
    and above `min_us`; the long gaps summed by (host phase, innermost host op) at their
    midpoint, and the `top` longest listed with their start (ms from the first kernel)."""
    events = list(prof.events())
    busy = _gpu_intervals(events)
    if len(busy) < 2:
        return {"idle_ms_per_step": 0.0, "long_gaps": 0}
    cpu = [e for e in events if e.device_type != CUDA]
    t0 = busy[0][0]
    short = 0.0
    long_gaps: list[tuple[float, float]] = []
    for (_, end), (start, _) in zip(busy, busy[1:]):
        gap = start - end
        if gap >= min_us:
            long_gaps.append((end, start))
        else:
            short += gap
    blame: dict[str, float] = defaultdict(float)
    listed = []
    for a, b in long_gaps:
        mid = (a + b) / 2
        who = f"{_innermost(cpu, mid, True)} / {_innermost(cpu, mid, False)}"
        blame[who] += (b - a) / 1e3 / steps
        listed.append({"at_ms": (a - t0) / 1e3, "ms": (b - a) / 1e3, "host": who})
    listed.sort(key=lambda g: -g["ms"])
    long_ms = sum(b - a for a, b in long_gaps) / 1e3
    return {
        "host_ops": host_ops(prof, steps),
        "idle_ms_per_step": (short / 1e3 + long_ms) / steps,
        "short_gap_ms_per_step": short / 1e3 / steps,
        "long_gap_ms_per_step": long_ms / steps,
        "long_gaps": len(long_gaps),
        "min_gap_us": min_us,
        "blame_ms_per_step": dict(sorted(blame.items(), key=lambda kv: -kv[1])),
        "longest": listed[:top],
    }


def host_ops(prof: Any, steps: int, top: int = 12) -> list[dict[str, Any]]:
    """The host ops with the most self time per step: a launch that waits for room in the
    queue, a synchronize or a pinned-memory allocation shows up here, not in the kernel sum."""
    rows = [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count / steps)
            for e in prof.key_averages() if not e.key.startswith("phase:")]
    rows.sort(key=lambda r: -r[1])
    return [{"op": k, "self_ms_per_step": ms, "calls_per_step": n} for k, ms, n in rows[:top]]


def print_gaps(report: dict[str, Any]) -> None:
    if not report.get("long_gaps"):
        print(f"GPU idle {report['idle_ms_per_step']:.3f} ms/step, no gap over the threshold")
        return
    print(f"GPU idle {report['idle_ms_per_step']:.3f} ms/step: gaps under "
          f"{report['min_gap_us']:.0f} µs {report['short_gap_ms_per_step']:.3f}, "
          f"{report['long_gaps']} longer ones {report['long_gap_ms_per_step']:.3f}")
    for who, ms in list(report["blame_ms_per_step"].items())[:8]:
        print(f"  {ms:8.3f} ms/step  host in {who[:100]}")
    for g in report["longest"]:
        print(f"  gap {g['ms']:7.3f} ms at {g['at_ms']:8.2f} ms  host in {g['host'][:90]}")
    for op in report.get("host_ops", []):
        print(f"  host {op['self_ms_per_step']:8.3f} ms/step self, {op['calls_per_step']:7.1f} "
              f"calls  {op['op'][:80]}")
