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
    return f"{_lo(b)}-{_hi(b)}" if _hi(b) > _lo(b) else str(_lo(b))


@dataclass
class DecodeComparison:
    """Both layouts' step at one bucket: `here` as an upper bound, `there` as a lower one,
    each from the bucket that bounds it most tightly (`here_rows`, `there_rows`)."""

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

    Two layouts rarely measure the same bucket: on one H200 a served burst left pp2 decoding
    8-15 rows while tp2 had decoded only the background's 1-7, so an exact-bucket comparison
    found nothing and auto went back to a layout 11x slower, every burst. Two facts of any
    batched step bound one bucket by another, without a model: a step is no cheaper with more
    rows (monotone), and no dearer than running its rows as several smaller steps
    (subadditive: step(r) <= ceil(r / k) * step(k)). So `here` at any bucket bounds its step at
    the judged one from above, `there` from below; when the bounds already say `here` is
    faster, it is."""

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
        """Both layouts' step at `rows`' bucket, bounded as the class says (None until both
        have measured some bucket); idle (`rows` None), at the largest bucket either measured."""
        mine, theirs = self._measured(here), self._measured(there)
        if not mine or not theirs:
            return None
        b = bucket(rows) if rows else max(set(mine) | set(theirs))
        upper = {k: ms * (_ceil_div(_hi(b), _lo(k)) if k < b else 1) for k, ms in mine.items()}
        lower = {k: ms / (_ceil_div(_hi(k), _lo(b)) if k > b else 1) for k, ms in theirs.items()}
        hb = min(upper, key=lambda k: (upper[k], abs(k - b)))
        tb = max(lower, key=lambda k: (lower[k], -abs(k - b)))
        return DecodeComparison(upper[hb], lower[tb], _span(b), _span(hb), _span(tb))


def _lo(b: int) -> int:
    return 1 << (b - 1)


def _hi(b: int) -> int:
    return (1 << b) - 1


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
