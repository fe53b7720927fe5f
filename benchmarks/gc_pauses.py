"""Python garbage-collector passes over a timed region (`gc.callbacks`): how many, how long,
the longest. A full pass over an unfrozen import heap stalled the engine's step loop for
235-320 ms on the H200's host (docs/benchmarks.md, sixth run); a benchmark that reports its
collector time shows at once whether that is back."""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPauses:
    """Context manager: every collection inside it, (generation, ms). Collections of any
    thread count: the engine's loop may run in another one."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []
        self._t0: float | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.passes.append((info["generation"], 1e3 * (time.perf_counter() - self._t0)))
            self._t0 = None

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def total_ms(self) -> float:
        return sum(ms for _, ms in self.passes)

    def summary(self) -> dict[str, Any]:
        """Totals, and the oldest generation's passes (the long ones) one by one."""
        total = self.total_ms()
        full = [round(ms, 2) for gen, ms in self.passes if gen == 2]
        return {"passes": len(self.passes), "total_ms": round(total, 2),
                "max_ms": round(max((ms for _, ms in self.passes), default=0.0), 2),
                "oldest_generation_ms": full, "frozen_objects": gc.get_freeze_count()}
