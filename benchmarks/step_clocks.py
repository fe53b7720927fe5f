"""Per-step clocks for `profile_offline`, without a profiler (whose per-op cost inflates
exactly the host time in question and moves the GPU's idle gaps).

`HostClock` times the engine's host phases of each step with perf_counter. `GpuClock` puts a
CUDA event on the compute stream where each step's forward starts and where its sampling ends:
on the GPU's own timeline a step's *span* (its work from first kernel to last, bubbles
included) and the *idle before* it (from the previous step's last kernel to this step's first,
which is zero whenever the host queued the step in time). A band of steps whose idle is large
is host-bound; whose span exceeds its kernels' sum (a profile window says) launch-bound.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from benchmarks.common import adds_seconds, wrap_method

SEQ_BANDS = (0, 100, 200, 400, 700, 10**9)


class HostClock:
    """perf_counter totals of the engine's host phases within each step. `forward` of a
    replayed graph is its input preparation and launch; `tokens` includes the wait for the
    previous step's tokens."""

    PHASES = (("schedule", "scheduler", "schedule"), ("forward", "runner", "forward"),
              ("sample", "sampling", "sample_ahead"), ("tokens", "outputs", "take_tokens"),
              ("text", "outputs", "emit_text"))

    def __init__(self, core: Any) -> None:
        self.step: dict[str, float] = defaultdict(float)
        for label, owner, name in self.PHASES:
            wrap_method(getattr(core, owner), name,
                        lambda label=label: adds_seconds(self.step, label))

    def take(self) -> dict[str, float]:
        """This step's phase times (ms), reset for the next."""
        out = {k: round(v * 1e3, 3) for k, v in self.step.items()}
        self.step.clear()
        return out


@contextmanager
def _before(mark: Callable[[], None]) -> Iterator[None]:
    mark()
    yield


@contextmanager
def _after(mark: Callable[[], None]) -> Iterator[None]:
    try:
        yield
    finally:
        mark()


class GpuClock:
    """CUDA events at each step's first forward and last sampling call (`event`: makes one,
    default a timing `torch.cuda.Event`; tests pass a fake). For one-GPU layouts: rank 0's
    compute stream only (other ranks' GPUs and side streams such as HiCache copies are not
    seen), and PP decode groups sample a step launched earlier."""

    def __init__(self, core: Any, event: Any = None) -> None:
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._start: Any = None
        self._end: Any = None
        self.pairs: list[tuple[Any, Any]] = []  # (start, end) of each step taken
        wrap_method(core.runner, "forward", lambda: _before(self.mark_start))
        for name in ("sample", "sample_ahead"):
            wrap_method(core.sampling, name, lambda: _after(self.mark_end))

    def mark_start(self) -> None:
        if self._start is None:  # the step's first forward (PP micro-batches: several)
            self._start = self._event()
            self._start.record()

    def mark_end(self) -> None:
        self._end = self._event()  # the step's last sampling call wins
        self._end.record()

    def take(self) -> int | None:
        """Closes this step; the index of its event pair (None: it launched nothing)."""
        start, end, self._start, self._end = self._start, self._end, None, None
        if start is None or end is None:
            return None
        self.pairs.append((start, end))
        return len(self.pairs) - 1

    def discard(self) -> None:
        """Forgets the marks since the last `take` (a profiled window's steps)."""
        self._start = self._end = None

    def times(self) -> list[dict[str, float]]:
        """Per pair: span and idle-before in ms on the GPU's timeline (after a synchronize)."""
        out, prev_end = [], None
        for start, end in self.pairs:
            idle = 0.0 if prev_end is None else max(0.0, prev_end.elapsed_time(start))
            out.append({"span": round(start.elapsed_time(end), 4), "idle_before": round(idle, 4)})
            prev_end = end
        return out


def attach_gpu_times(records: list[dict], clock: GpuClock) -> None:
    """Replaces each record's event index ("gpu_pair") by its times ("gpu_ms")."""
    times = clock.times()
    for r in records:
        i = r.pop("gpu_pair", None)
        if i is not None:
            r["gpu_ms"] = times[i]


def summarize_bands(records: list[dict], key: str, kinds: tuple[str, ...]
                    ) -> list[dict[str, Any]]:
    """Mean step wall and the records' `key` times (ms: "host_ms" or "gpu_ms") by step kind
    and batch-size band."""
    out = []
    for kind in kinds:
        for lo, hi in zip(SEQ_BANDS, SEQ_BANDS[1:]):
            rs = [r for r in records if r["kind"] == kind and key in r
                  and lo <= r["sequences"] < hi]
            if not rs:
                continue
            means: dict[str, float] = defaultdict(float)
            for r in rs:
                for k, v in r[key].items():
                    means[k] += v / len(rs)
            out.append({"kind": kind, "sequences": f"{lo}-{min(hi, 10**4) - 1}",
                        "steps": len(rs),
                        "step_ms": 1e3 * sum(r["seconds"] for r in rs) / len(rs),
                        key: dict(means)})
    return out
