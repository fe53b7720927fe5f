"""Each layout's measured decode step time, by batch size.

The policy sends the prefill layout back to the decode layout once a backlog is served,
on the premise that the decode layout decodes faster. That premise can be false: two ranks
sharing one GPU over gloo decode ~12× faster in pp2 than in tp2 (staged all-reduces go
through the host), and going back cost auto 7 % of static pp2's throughput on that rig. So
pure decode steps are kept per layout and batch-size bucket, and the policy stays where it
is when the measured steps bound both layouts at the running batch and the one it is in is
clearly faster (law 5: unmeasured means the premise stands, as before)."""

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


def _span(b: int) -> str:
    lo, hi = 1 << (b - 1), (1 << b) - 1
    return f"{lo}-{hi}" if hi > lo else str(lo)


@dataclass
class DecodeComparison:
    """Both layouts' step at one bucket, each read at the nearest bucket it measured that
    bounds it (`here` at that bucket or a larger one, `there` at it or a smaller one)."""

    here_ms: float
    there_ms: float
    rows: str  # the judged bucket's range, e.g. "4-7"
    here_rows: str
    there_rows: str

    @property
    def here_faster(self) -> bool:
        return self.here_ms <= STAY_RATIO * self.there_ms

    def as_dict(self) -> dict[str, float | str]:
        out: dict[str, float | str] = {"here_ms": round(self.here_ms, 3),
                                       "there_ms": round(self.there_ms, 3), "rows": self.rows}
        if (self.here_rows, self.there_rows) != (self.rows, self.rows):
            out |= {"here_rows": self.here_rows, "there_rows": self.there_rows}
        return out


class DecodeCosts:
    """Median pure-decode step time (ms) per (layout, batch bucket), over the last WINDOW: a
    median, so a step that captured a decode graph after a seam (0.3-0.5 s) moves nothing.

    Two layouts rarely measure the same bucket: on one H200 the served burst left pp2 decoding
    8-15 rows while tp2 had only decoded the background's 4-7, so an exact-bucket comparison
    found nothing and auto went back to a layout 11x slower, every burst. A decode step does not
    get cheaper with more rows, so `here` measured at a larger bucket is an upper bound of its
    step at the judged one, and `there` at a smaller bucket a lower bound: when the bounds
    already say `here` is faster, it is (a bound, not an interpolation)."""

    def __init__(self) -> None:
        self._ms: dict[tuple[Layout, int], deque[float]] = {}

    def observe(self, layout: Layout, rows: int, ms: float) -> None:
        self._ms.setdefault((layout, bucket(rows)), deque(maxlen=WINDOW)).append(ms)

    def _median(self, layout: Layout, b: int) -> float | None:
        steps = self._ms.get((layout, b))
        return median(steps) if steps and len(steps) >= MIN_STEPS else None

    def _measured(self, layout: Layout) -> dict[int, float]:
        out = {b: self._median(lay, b) for (lay, b) in self._ms if lay == layout}
        return {b: ms for b, ms in out.items() if ms is not None}

    def compare(self, here: Layout, there: Layout, rows: int | None
                ) -> DecodeComparison | None:
        """Both layouts' step at `rows`' bucket, bounded as the class says (None when no
        bound exists: neither measured near it); idle (`rows` None), at the largest bucket
        that has one."""
        mine, theirs = self._measured(here), self._measured(there)
        if not mine or not theirs:
            return None
        judged = [bucket(rows)] if rows else sorted(set(mine) | set(theirs), reverse=True)
        for b in judged:
            upper = [k for k in mine if k >= b]  # here's step at b is at most these
            lower = [k for k in theirs if k <= b]  # there's step at b is at least these
            if upper and lower:
                hb = min(upper, key=lambda k: (mine[k], k))
                tb = max(lower, key=lambda k: (theirs[k], -k))
                return DecodeComparison(mine[hb], theirs[tb], _span(b), _span(hb), _span(tb))
        return None
