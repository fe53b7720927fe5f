"""A layout's prefill step cost, fitted as seconds = a + b·tokens (the flip policy's X and P).

Why a fit and not a rate: a step has a fixed cost. A staged tp2 step on one shared GPU costs
0.1–0.5 s whatever its size, so one lone 40-token prompt "measured" X at ~100 tokens/s as
tokens ÷ seconds, N came out tiny and the policy flipped on background traffic. The fit
keeps the fixed cost a apart from the per-token cost b, and the policy prices a backlog at
the rate of the step it would really run in: X_eff(S) = S / (a + b·S), S being the step's
tokens (the prefill budget, or the backlog if smaller). Small steps then set a, not the
price of a token.

Provenance (law 5): a fit is `measured` only when it rests on MIN_SAMPLES steps (or one step
of at least S tokens: the step priced was seen, no split of a and b is needed) of at least
MIN_TOKENS prompt tokens in all (fewer when the prefill budget caps a step lower) and S is at
most EXTRAPOLATE× the largest step it saw; before, its value is reported `half-measured` with a
note saying what is missing (`provisional`), and the policy does not flip on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

from phaseflip.flip.estimate import HALF, MEASURED, Estimate

PREFILL_SHARE = 0.9  # a step measures prefill throughput when this much of it is prompt
MIN_PREFILL_TOKENS = 32  # below this a step measures its fixed overhead, not throughput
FIT_WINDOW = 16  # recent qualifying steps per layout: enough to average out noise, recent
# enough to follow a load that changed
MIN_SAMPLES = 3  # one or two steps cannot tell a fixed cost from a per-token one
MIN_TOKENS = 1024  # below this a layout has seen only short steps, mostly fixed cost (or
# MIN_SAMPLES full steps, when the prefill budget caps a step below MIN_TOKENS / MIN_SAMPLES:
# a backlog runs in such steps, so they price it as they ran)
SPAN = 2.0  # the steps' sizes span a range (a and b are both fitted) when the largest is
# at least this many times the smallest
LAG_TRAIL = 64  # recent steps of every kind the run-ahead test reads
LAG_MIN_STEPS = 8  # fewer: no run-ahead test (lag 0)
LAG_EVIDENCE = 4.0  # run-ahead is taken only when it leaves this many times less squared error:
# steady same-size steps fit either way, the lone steps that tell them apart are few
EXTRAPOLATE = 4.0  # a price is measured only for a step up to this factor past the largest
# seen: beyond, the slope of small, noisy steps would price a backlog's large ones


@dataclass(frozen=True)
class StepFit:
    """seconds = fixed_s + per_token_s · tokens; `how` the fit got there."""

    fixed_s: float
    per_token_s: float
    how: str  # "fit" | "fit through 0" | "a from small steps" | "rate"

    def seconds(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def rate_at(self, tokens: float) -> float:
        """Prefill tokens/s of a step of `tokens` prompt tokens."""
        return tokens / self.seconds(tokens)


def fit_steps(samples: Sequence[tuple[int, float]], fixed_s: float | None = None) -> StepFit:
    """Least squares with a ≥ 0, b > 0 when the steps' sizes span SPAN×; else a from
    `fixed_s` (the layout's small steps) when it is below the steps' mean; else a plain rate
    (a = 0, the old ratio). The last two pass through the steps' mean, so a step of their
    size is priced as they ran."""
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    ms = sum(s for _, s in samples) / n
    tokens = [t for t, _ in samples]
    if max(tokens) >= SPAN * min(tokens):
        var = sum((t - mt) ** 2 for t in tokens)
        b = sum((t - mt) * (s - ms) for t, s in samples) / var
        if b > 0:  # (b ≤ 0: noise over the fixed cost, the slope says nothing)
            if ms - b * mt >= 0:
                return StepFit(ms - b * mt, b, "fit")
            # a < 0 unconstrained: the constraint binds, refit through the origin
            return StepFit(0.0, sum(t * s for t, s in samples) /
                           sum(t * t for t in tokens), "fit through 0")
    if fixed_s is not None and 0.0 <= fixed_s < ms:
        return StepFit(fixed_s, (ms - fixed_s) / mt, "a from small steps")
    return StepFit(0.0, ms / mt, "rate")


class _Line:
    """Running sums of (x, y) pairs: the squared error of their least-squares line in O(1)
    (decide runs every step; refitting 64 steps each time was ~0.5 ms)."""

    def __init__(self) -> None:
        self.n, self.sums = 0, [0.0] * 5  # x, y, xx, xy, yy

    def add(self, x: float, y: float, sign: int = 1) -> None:
        self.n += sign
        for i, v in enumerate((x, y, x * x, x * y, y * y)):
            self.sums[i] += sign * v

    def rss(self) -> float:
        if self.n < 2:
            return 0.0
        sx, sy, sxx, sxy, syy = self.sums
        cxx, cxy, cyy = sxx - sx * sx / self.n, sxy - sx * sy / self.n, syy - sy * sy / self.n
        fitted = cxy * cxy / cxx if cxx > 1e-9 * max(sxx, 1.0) else 0.0  # (x all alike: none)
        return max(0.0, cyy - fitted)


class PrefillCostModel:
    """One layout's steps, each charged two ways: to itself (lag 0) and, for run-ahead, to the
    step before it (lag 1: with overlap scheduling on a GPU a step's wall time is mostly the
    previous step's GPU time, so a lone prefill step's cost lands in the next step). Per lag:
    a bounded window of qualifying prefill steps and of small steps (their seconds: the fixed
    cost when the prefill steps do not span a range). The lag used is the one that explains
    the recent steps' times (`lag`): 0 unless run-ahead clearly fits better."""

    def __init__(self, max_step_tokens: int) -> None:
        self.min_tokens = min(MIN_TOKENS, MIN_SAMPLES * max_step_tokens)
        self.windows = [(deque(maxlen=FIT_WINDOW), deque(maxlen=FIT_WINDOW)) for _ in (0, 1)]
        self.trail: deque[tuple[int, int, float]] = deque(maxlen=LAG_TRAIL)
        self.lines = [_Line(), _Line()]  # the trail's (prompt tokens charged, seconds) per lag
        self.prev: tuple[int, int] | None = None  # the step before, in this layout
        self._memo: tuple[int, StepFit | None] | None = None  # (lag, fit) until a step
        self._priced: dict[int, Estimate] = {}  # estimate by step tokens, until a step
        self._added = 0

    def observe(self, prompt_tokens: int, decode_rows: int, seconds: float) -> None:
        """One step of this layout (an idle one too: run ahead, it waits out the step
        before)."""
        step = (prompt_tokens, decode_rows)
        for lag, charged in enumerate((step, self.prev)):
            if charged is None or seconds <= 0 or sum(charged) == 0:
                continue  # nothing ran in the step charged
            (p, d), (steps, small) = charged, self.windows[lag]
            if p < MIN_PREFILL_TOKENS:
                small.append(seconds)  # its fixed cost, for a fit whose steps do not span
            elif p >= PREFILL_SHARE * (p + d):
                steps.append((p, seconds))
        if self.prev is not None:
            self._trail((prompt_tokens, self.prev[0], seconds))
        self.prev, self._memo = step, None
        self._priced.clear()

    def _trail(self, entry: tuple[int, int, float]) -> None:
        """Appends to the trail, its sums kept (rebuilt once a trail's length, so that
        rounding does not pile up)."""
        if len(self.trail) == LAG_TRAIL:
            old = self.trail[0]
            for lag, line in enumerate(self.lines):
                line.add(old[lag], old[2], -1)
        self.trail.append(entry)
        self._added += 1
        if self._added % LAG_TRAIL == 0:
            self.lines = [_Line(), _Line()]
            for t in self.trail:
                for lag, line in enumerate(self.lines):
                    line.add(t[lag], t[2])
        else:
            for lag, line in enumerate(self.lines):
                line.add(entry[lag], entry[2])

    def seam(self) -> None:
        """The layout was left: a seam drains every step, its next one pairs with none."""
        self.prev = None

    def lag(self) -> int:
        """1 when charging each step's time to the step before explains the recent steps
        LAG_EVIDENCE× better (least squares on prompt tokens), else 0."""
        return self._current()[0]

    def fit(self) -> StepFit | None:
        return self._current()[1]

    @property
    def steps(self) -> deque[tuple[int, float]]:
        return self.windows[self.lag()][0]

    def _current(self) -> tuple[int, StepFit | None]:
        if self._memo is None:
            rss = [line.rss() for line in self.lines]
            lag = int(len(self.trail) >= LAG_MIN_STEPS and rss[1] * LAG_EVIDENCE < rss[0])
            steps, small = self.windows[lag]
            fit = fit_steps(steps, median(small) if small else None) if steps else None
            self._memo = (lag, fit)
        return self._memo

    def missing(self, step_tokens: int) -> list[str]:
        """Why a price at `step_tokens` is not measured yet (empty: it is)."""
        tokens = [t for t, _ in self.steps]
        out = []
        # a step of S tokens or more prices S as it ran (or errs high, a = 0 below it: fewer
        # flips); the 3 steps a burst waited in TP cost 8B tp4 at 25 GB/s 1.309 -> 1.294x
        if len(tokens) < MIN_SAMPLES and not (tokens and max(tokens) >= step_tokens):
            out.append(f"{len(tokens)} of {MIN_SAMPLES} steps")
        if sum(tokens) < self.min_tokens:
            out.append(f"{sum(tokens)} of {self.min_tokens} tokens")
        if tokens and step_tokens > EXTRAPOLATE * max(tokens):  # (below: toward a, fitted)
            out.append(f"a {step_tokens}-token step is past {EXTRAPOLATE:g}x the largest "
                       f"seen, {max(tokens)}")
        return out

    def estimate(self, step_tokens: int) -> Estimate:
        """Tokens/s of a `step_tokens`-token step; `provisional` until `missing` is empty."""
        got = self._priced.get(step_tokens)
        if got is None:
            got = self._priced[step_tokens] = self._estimate(step_tokens)
        return got

    def _estimate(self, step_tokens: int) -> Estimate:
        fit = self.fit()
        if fit is None:
            return Estimate(None)
        note = (f"{fit.fixed_s * 1e3:.1f} ms + {fit.per_token_s * 1e6:.2f} us/token "
                f"({fit.how}{', run-ahead: times charged a step back' if self.lag() else ''}) "
                f"at {step_tokens} tokens")
        gaps = self.missing(step_tokens)
        if gaps:
            return Estimate(fit.rate_at(step_tokens), HALF, len(self.steps),
                            f"provisional ({', '.join(gaps)}): {note}", provisional=True)
        return Estimate(fit.rate_at(step_tokens), MEASURED, len(self.steps), note)

    def describe(self) -> dict[str, Any] | None:
        """The fit for the snapshot: a, b, how, and what it rests on."""
        fit = self.fit()
        if fit is None:
            return None
        lag = self.lag()
        steps, small = self.windows[lag]
        return {"fixed_s": fit.fixed_s, "per_token_s": fit.per_token_s, "how": fit.how,
                "steps": len(steps), "tokens": sum(t for t, _ in steps),
                "small_steps": len(small), "lag": lag}
