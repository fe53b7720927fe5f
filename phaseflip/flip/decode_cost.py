"""Each layout's measured decode step time, by batch size.

The policy sends the prefill layout back to the decode layout once a backlog is served,
on the premise that the decode layout decodes faster. That premise can be false: two ranks
sharing one GPU over gloo decode ~12× faster in pp2 than in tp2 (staged all-reduces go
through the host), and going back cost auto 7 % of static pp2's throughput on that rig. So
pure decode steps are kept per layout and batch-size bucket, and the policy stays where it
is when both layouts are measured at a comparable batch and the one it is in is clearly
faster (law 5: unmeasured means the premise stands, as before)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median

Layout = tuple[int, int]

WINDOW = 16  # steps kept per layout and bucket
MIN_STEPS = 4  # steps a bucket needs before it is compared
STAY_RATIO = 0.9  # stay only when this layout's step is <= 0.9x the other's (hysteresis)


def bucket(rows: int) -> int:
    """Powers of two: 1, 2-3, 4-7, ... decode rows share a bucket."""
    return max(1, rows).bit_length()


@dataclass
class DecodeComparison:
    here_ms: float
    there_ms: float
    rows: str  # the bucket's range, e.g. "4-7"

    @property
    def here_faster(self) -> bool:
        return self.here_ms <= STAY_RATIO * self.there_ms

    def as_dict(self) -> dict[str, float | str]:
        return {"here_ms": round(self.here_ms, 3), "there_ms": round(self.there_ms, 3),
                "rows": self.rows}


class DecodeCosts:
    """Median pure-decode step time (ms) per (layout, batch bucket), over the last WINDOW: a
    median, so a step that captured a decode graph after a seam (0.3-0.5 s) moves nothing."""

    def __init__(self) -> None:
        self._ms: dict[tuple[Layout, int], deque[float]] = {}

    def observe(self, layout: Layout, rows: int, ms: float) -> None:
        self._ms.setdefault((layout, bucket(rows)), deque(maxlen=WINDOW)).append(ms)

    def _median(self, layout: Layout, b: int) -> float | None:
        steps = self._ms.get((layout, b))
        return median(steps) if steps and len(steps) >= MIN_STEPS else None

    def compare(self, here: Layout, there: Layout, rows: int | None
                ) -> DecodeComparison | None:
        """Both layouts' step at `rows`' bucket (None when they have not both measured it:
        another batch size is no comparison); idle (`rows` None), at the largest bucket both
        have measured."""
        shared = sorted({b for (lay, b) in self._ms if lay == here and
                         self._median(here, b) is not None and self._median(there, b) is not None})
        if rows:
            if bucket(rows) not in shared:
                return None
            b = bucket(rows)
        elif shared:
            b = shared[-1]
        else:
            return None
        lo, hi = 1 << (b - 1), (1 << b) - 1
        return DecodeComparison(self._median(here, b), self._median(there, b),  # type: ignore[arg-type]
                                f"{lo}-{hi}" if hi > lo else str(lo))
