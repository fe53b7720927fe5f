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


def token_rule(tokens: int, pp_size: int, min_tokens: int) -> int:
    """The launch rule: T // min_tokens parts, clamped to [p, 4p]."""
    return min(max(tokens // max(min_tokens, 1), pp_size), 4 * pp_size)


def pipeline_s(parts: int, tokens: int, pp_size: int, fixed_s: float, per_token_s: float
               ) -> float:
    """The modelled wall time of `tokens` cut into `parts` over `pp_size` stages."""
    return (parts + pp_size - 1) * (fixed_s + per_token_s * tokens / parts)


class MicroBatchSizer:
    """Rank 0's part count for a prompt step: the token rule, then the fitted stage time."""

    def __init__(self, pp_size: int, min_tokens: int) -> None:
        self.pp_size = pp_size
        self.min_tokens = min_tokens
        self._parts: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._kept: tuple[float, float] | None = None  # the last fit, while sizes converge

    def observe(self, tokens: int, seconds: float) -> None:
        """One prompt part's stage time on rank 0 (its forward, launch to finish)."""
        if tokens > 0 and seconds > 0:
            self._parts.append((tokens, seconds))
            self.fit()  # keeps the window's line before same-size parts can crowd it out

    def fit(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * tokens by least squares over the window; the last such
        fit while the window cannot make one (its parts converged on one size once the fit
        chose it); None until measured."""
        now = self._fit_window()
        if now is not None:
            self._kept = now
        return self._kept

    def _fit_window(self) -> tuple[float, float] | None:
        """None for too few parts, too little spread in their sizes, or a line that is not a
        cost (a < 0, b <= 0)."""
        if len(self._parts) < MIN_PARTS:
            return None
        xs = [t for t, _ in self._parts]
        if max(xs) < MIN_SPREAD * min(xs):
            return None
        n = len(xs)
        mx = sum(xs) / n
        my = sum(s for _, s in self._parts) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (s - my) for x, s in self._parts) / sxx
        a = my - b * mx
        if b <= 0 or a < 0:
            return None
        return a, b

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
        return {"parts_observed": len(self._parts),
                "fixed_s": None if fit is None else fit[0],
                "per_token_s": None if fit is None else fit[1],
                "rule": "tokens" if fit is None else "stage time"}


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

    def harvest(self) -> None:
        """The parts whose events have completed, into the sizer (in order; stops at the
        first still running)."""
        while self._pending and self._pending[0][2].query():  # type: ignore[attr-defined]
            tokens, began, end = self._pending.popleft()
            self.sizer.observe(tokens, 1e-3 * began.elapsed_time(end))  # type: ignore[attr-defined]
