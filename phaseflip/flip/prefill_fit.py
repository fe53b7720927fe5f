"""A layout's prefill step cost, fitted as seconds = a + b·tokens (the flip policy's X and P).

Why a fit and not a rate: a step has a fixed cost. A staged tp2 step on one shared GPU costs
0.1–0.5 s whatever its size, so one lone 40-token prompt "measured" X at ~100 tokens/s as
tokens ÷ seconds, N came out tiny and the policy flipped on background traffic. The fit
keeps the fixed cost a apart from the per-token cost b, and the policy prices a backlog at
the rate of the step it would really run in: X_eff(S) = S / (a + b·S), S being the step's
tokens (the prefill budget, or the backlog if smaller). Small steps then set a, not the
price of a token.

Provenance (law 5): a fit is `measured` only when it rests on MIN_SAMPLES steps of at least
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

FIT_WINDOW = 16  # recent qualifying steps per layout: enough to average out noise, recent
# enough to follow a load that changed
MIN_SAMPLES = 3  # one or two steps cannot tell a fixed cost from a per-token one
MIN_TOKENS = 1024  # below this a layout has seen only short steps, mostly fixed cost (or
# MIN_SAMPLES full steps, when the prefill budget caps a step below MIN_TOKENS / MIN_SAMPLES:
# a backlog runs in such steps, so they price it as they ran)
SPAN = 2.0  # the steps' sizes span a range (a and b are both fitted) when the largest is
# at least this many times the smallest
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


class PrefillCostModel:
    """One layout's qualifying prefill steps (a bounded window) and its small steps (their
    seconds: the fixed cost when the prefill steps do not span a range)."""

    def __init__(self, max_step_tokens: int) -> None:
        self.min_tokens = min(MIN_TOKENS, MIN_SAMPLES * max_step_tokens)
        self.steps: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)
        self.small_s: deque[float] = deque(maxlen=FIT_WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.steps.append((tokens, seconds))

    def observe_small(self, seconds: float) -> None:
        """A step too small to measure prefill (a decode step, a few prompt tokens)."""
        if seconds > 0:
            self.small_s.append(seconds)

    def fit(self) -> StepFit | None:
        if not self.steps:
            return None
        return fit_steps(self.steps, median(self.small_s) if self.small_s else None)

    def missing(self, step_tokens: int) -> list[str]:
        """Why a price at `step_tokens` is not measured yet (empty: it is)."""
        tokens = [t for t, _ in self.steps]
        out = []
        if len(tokens) < MIN_SAMPLES:
            out.append(f"{len(tokens)} of {MIN_SAMPLES} steps")
        if sum(tokens) < self.min_tokens:
            out.append(f"{sum(tokens)} of {self.min_tokens} tokens")
        if tokens and step_tokens > EXTRAPOLATE * max(tokens):  # (below: toward a, fitted)
            out.append(f"a {step_tokens}-token step is past {EXTRAPOLATE:g}x the largest "
                       f"seen, {max(tokens)}")
        return out

    def estimate(self, step_tokens: int) -> Estimate:
        """Tokens/s of a `step_tokens`-token step; `provisional` until `missing` is empty."""
        fit = self.fit()
        if fit is None:
            return Estimate(None)
        note = (f"{fit.fixed_s * 1e3:.1f} ms + {fit.per_token_s * 1e6:.2f} us/token "
                f"({fit.how}) at {step_tokens} tokens")
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
        return {"fixed_s": fit.fixed_s, "per_token_s": fit.per_token_s, "how": fit.how,
                "steps": len(self.steps), "tokens": sum(t for t, _ in self.steps),
                "small_steps": len(self.small_s)}
