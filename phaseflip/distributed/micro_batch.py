"""How many micro-batches a pipeline step with prompt tokens is cut into, by stage time.

m parts of a T-token step over p stages take about (m + p - 1) * (a + b * T / m): every part
pays a fixed cost a (its launches, its hand-off, the matmuls' inefficiency on a short part)
and b per token, and the pipeline fills and drains over p - 1 extra part times. More parts
shrink the bubble and pay a more often; the best m is near sqrt((p - 1) * b * T / a). The old
rule (T // pp_min_micro_batch_tokens parts, clamped to [p, 4p]) is that choice for one guessed
a/b: right for large matmuls on a GPU, wrong where a part's fixed cost is large (ranks staging
through the host, CPU gloo), where fewer, larger parts win.

So rank 0, which decides every step (one decider), times its own stage's prompt parts (the
stages hold equal layer ranges), fits a + b * tokens over the last WINDOW parts, and sends the
part count in the step message; every stage cuts the plan by it. Until the fit is measured
(law 5), the token rule stands.
"""

from __future__ import annotations

import time
from collections import deque

import torch

WINDOW = 64  # prompt parts kept for the fit
MIN_PARTS = 8  # parts observed before the fit is used
MIN_SPREAD = 1.5  # largest / smallest part in the window: a line needs two distinct sizes
MIN_PART_TOKENS = 64  # no more parts than this many tokens each allow, past pp_size
OUTLIER = 4.0  # a part this many times its predicted time is a stall, not a cost
RESET = 8  # stalls in a row: the costs changed
TRIM = 4.0  # residuals past this many times the median one are dropped from the fit


def token_rule(tokens: int, pp_size: int, min_tokens: int) -> int:
    """The launch rule: T // min_tokens parts, clamped to [p, 4p]."""
    return min(max(tokens // max(min_tokens, 1), pp_size), 4 * pp_size)


def pipeline_s(parts: int, tokens: int, pp_size: int, fixed_s: float, per_token_s: float
               ) -> float:
    """The modelled wall time of `tokens` cut into `parts` over `pp_size` stages."""
    return (parts + pp_size - 1) * (fixed_s + per_token_s * tokens / parts)


class MicroBatchSizer:
    """Rank 0's part count for a prompt step: the token rule, then the fitted stage time.

    Robust to the stalls a wall clock sees (a compile, a GC pause, a preempted host: 1.5-2 s
    on the H200): a part slower than OUTLIER x the fit's prediction is left out, unless
    RESET of them come in a row (then the costs changed, and the window starts over), and
    the fit is refitted without points whose residual is far past the window's median one.
    A window whose line is no cost forgets the kept fit, so no stale fit outlives its
    evidence."""

    def __init__(self, pp_size: int, min_tokens: int) -> None:
        self.pp_size = pp_size
        self.min_tokens = min_tokens
        self._parts: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._kept: tuple[float, float] | None = None  # the last fit, while sizes converge
        self._stalls: list[tuple[int, float]] = []  # outliers in a row, not in the window
        self.outliers = 0
        self._dirty = False  # parts observed since the last fit

    def forget(self) -> None:
        """Back to the token rule, nothing measured (after a launch warm-up: its parts
        carried the kernels' compile)."""
        self._parts.clear()
        self._kept, self._stalls, self.outliers, self._dirty = None, [], 0, False

    def observe(self, tokens: int, seconds: float) -> None:
        """One prompt part's stage time on rank 0 (its forward, launch to finish)."""
        if tokens <= 0 or seconds <= 0:
            return
        fit = self._kept
        if fit is not None and seconds > OUTLIER * (fit[0] + fit[1] * tokens):
            self.outliers += 1
            self._stalls.append((tokens, seconds))
            if len(self._stalls) < RESET:
                return
            self._parts.clear()  # the costs changed: measure them again
            self._kept = None
            self._parts.extend(self._stalls)
        self._stalls = []
        self._parts.append((tokens, seconds))
        self._dirty = True
        self.fit()  # keeps the window's line before same-size parts can crowd it out

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * tokens over the window; the last such fit while the
        window cannot make one (its parts converged on one size once the fit chose it); None
        until measured, or once the window's line is no cost."""
        if not self._dirty:
            return self._kept
        self._dirty = False
        xs = [t for t, _ in self._parts]
        if len(xs) >= MIN_PARTS and max(xs) >= MIN_SPREAD * min(xs):
            self._kept = _robust_line(list(self._parts))
        return self._kept

    def parts(self, tokens: int) -> int:
        """How many parts a step of `tokens` prompt tokens is cut into."""
        p = self.pp_size
        fit = self.fit()
        if fit is None:
            return token_rule(tokens, p, self.min_tokens)
        most = min(tokens, max(p, min(4 * p, tokens // MIN_PART_TOKENS)))  # p as before
        return min(range(1, most + 1), key=lambda m: pipeline_s(m, tokens, p, *fit))

    def snapshot(self) -> dict[str, float | int | str | None]:
        fit = self.fit()
        return {"parts_observed": len(self._parts), "outliers": self.outliers,
                "fixed_s": None if fit is None else fit[0],
                "per_token_s": None if fit is None else fit[1],
                "rule": "tokens" if fit is None else "stage time"}


def _line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least squares a + b x with a clamped at 0 (attention's quadratic term can pull the
    intercept below zero: then the line through the origin); None when b <= 0."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx <= 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    if a < 0:
        a, b = 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return (a, b) if b > 0 else None


def _robust_line(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """`_line`, refitted without the points whose residual is past TRIM x the median one."""
    first = _line(points)
    if first is None:
        return None
    res = [abs(y - first[0] - first[1] * x) for x, y in points]
    cut = TRIM * sorted(res)[len(res) // 2]
    kept = [p for p, r in zip(points, res) if r <= cut]
    if cut <= 0 or len(kept) < MIN_PARTS or len({x for x, _ in kept}) < 2:
        return first
    return _line(kept)


class PartClock:
    """Times rank 0's prompt parts for a `MicroBatchSizer`, from the part's forward to its
    hand-off posted. On a GPU the forward only launches, so a part is an event pair on the
    stream, read once done (`harvest`, never waiting); on the CPU the wall time is the part's."""

    def __init__(self, sizer: MicroBatchSizer, device: torch.device) -> None:
        self.sizer = sizer
        self.cuda = device.type == "cuda"
        self._pending: deque[tuple[int, object, object]] = deque()

    def start(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, began: object, tokens: int) -> None:
        if not self.cuda:
            self.sizer.observe(tokens, time.perf_counter() - began)  # type: ignore[operator]
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((tokens, began, end))

    def forget(self) -> None:
        """Every part timed so far, read or not, is dropped (`MicroBatchSizer.forget`)."""
        self._pending.clear()
        self.sizer.forget()

    def harvest(self) -> None:
        """The parts whose events have completed, into the sizer (in order; stops at the
        first still running)."""
        while self._pending and self._pending[0][2].query():  # type: ignore[attr-defined]
            tokens, began, end = self._pending.popleft()
            self.sizer.observe(tokens, 1e-3 * began.elapsed_time(end))  # type: ignore[attr-defined]
