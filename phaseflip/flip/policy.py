"""The automatic flip policy (`--flip-policy auto`, docs/design.md): flip when the flip pays.

Cost model. Serving P uncached prefill tokens takes U/X seconds in the decode layout (TP) and
U/P in the prefill layout (PP), X and P being their prefill throughputs. A flip there and back
costs C = C(TP→PP) + C(PP→TP) seconds (law 7: one estimator per direction, a decision priced on
the round trip). So the flip pays once U exceeds the break-even

    N = C / (1/X − 1/P)        (never when P ≤ X)

and the prefill layout flips back once the backlog is served (U ≤ f·N, f =
--flip-backlog-served-fraction: what is left would save less than f of a round trip), or when
its decode steps exceed --flip-decode-slo-ms. Both flips wait out a dwell (seconds and steps in
the layout since the last flip; the launch layout owes none: a burst at start waited 4 steps
of 1.7 s in the simulated 70B tp4 at 25 GB/s), so the policy cannot thrash. An engine left
idle in the prefill layout flips back once it has been idle --flip-min-dwell-s
(`idle_flip_due`: the engine loop steps only when it has work, so the policy is otherwise never
asked), ready for the decode traffic that comes next.

Estimates (law 5): a value that nothing measured is None, never 0, and every estimate says
where it comes from: `measured`, `seed` (a config prior), `half-measured` (a seed applied to a
measurement, or a sum of measured and seeded parts) or `unmeasured` (None).
- Prefill throughput of a layout: seconds = a + b·tokens fitted to its recent steps that are
  mostly prefill (prompt tokens ≥ PREFILL_SHARE of the step's rows and ≥ MIN_PREFILL_TOKENS,
  `flip/prefill_fit.py`; with run-ahead, each step's time charged to the step before), priced at
  the step a backlog runs in: S = min(the scheduler's prefill budget of a step, pending tokens),
  X = S / (a + b·S). Short steps set the fixed cost a, not the price of a token. A fit from too
  few steps or tokens, or far from S, is 'half-measured' with a note (provisional), and no flip
  to the prefill layout is decided on it. The decode rows riding along are charged to the prompt
  tokens, an underestimate by at most 1 − PREFILL_SHARE, alike in both layouts.
- Flip cost of a direction: an EMA of its seams' `SeamCensus.total_s` plus an EMA of the
  refill that follows the cutover (`observe_refill`, once the ledger closes the window): the
  tokens the retracted requests re-prefilled ÷ the new layout's measured prefill rate, plus
  the host→device load seconds (bytes ÷ the loads' own rate, at most the window's wall
  time: concurrent loads' seconds are summed; an upper bound, loads overlap compute). Until
  a refill of that direction is measured, C is the seam alone, 'half-measured' with a note
  (law 5: not a zero refill).

Residency (law 8): pending work is priced by what it costs. A waiting request's tokens already
in the device prefix tree, in the HiCache host tier, or computed first by an earlier pending
request with the same prefix are not prefill work. The device tree is walked read-only (no LRU
touch, no split); the host tier is asked `contains` (no LRU touch); page keys are hashed once
per request and length. Pricing stops once the count crosses the threshold being decided, and
runs only when the raw token count (an upper bound) could cross it. It walks at most
PRICE_MAX_REQUESTS waiting requests a step (a long queue is not walked whole every step): the
tail's tokens are `unpriced_tokens`, and its work is extrapolated at the priced waiting
requests' uncached share (`work_tokens`; the queue of one phase is alike). Disk-tier
pages are priced as work: the disk store's `contains` may read a file on a miss, too costly per
step.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from phaseflip.flip.decode_cost import DecodeCosts
from phaseflip.flip.estimate import HALF, MEASURED, SEED, Estimate, combine
from phaseflip.flip.estimate import UNMEASURED as UNMEASURED  # re-exported
from phaseflip.flip.prefill_fit import PrefillCostModel

SEAM_ALPHA = 0.5  # weight of the newest seam in a direction's cost EMA (seams are few)
DECODE_WINDOW = 8  # steps with decode rows the SLO check averages (acts on a full window)
PRICE_MAX_REQUESTS = 64  # waiting requests residency pricing walks per decision

Layout = tuple[int, int]  # (tp_size, pp_size)


def layout_name(layout: Layout) -> str:
    return f"tp{layout[0]}×pp{layout[1]}"


def _ema(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else old + alpha * (new - old)


class CostEstimator:
    """Seconds of one flip direction, seam plus refill: the seed until a seam of that direction
    is measured; the seam alone ('half-measured', noted) until a refill of it is."""

    def __init__(self, seed_s: float | None) -> None:
        self.seed_s = seed_s
        self.seconds: float | None = None  # EMA of the seams
        self.refill_s: float | None = None  # EMA of the refills after their cutovers
        self.samples = self.refills = 0

    def observe(self, seconds: float) -> None:
        self.seconds = _ema(self.seconds, seconds, SEAM_ALPHA)
        self.samples += 1

    def observe_refill(self, seconds: float) -> None:
        self.refill_s = _ema(self.refill_s, seconds, SEAM_ALPHA)
        self.refills += 1

    def estimate(self) -> Estimate:
        if self.seconds is not None and self.refill_s is not None:
            return Estimate(self.seconds + self.refill_s, MEASURED, min(self.samples,
                                                                          self.refills))
        if self.seconds is not None:
            return Estimate(self.seconds, HALF, self.samples, "seam measured, refill not yet")
        return Estimate(self.seed_s, SEED) if self.seed_s is not None else Estimate(None)


# ---------------------------------------------------------------------- residency (law 8)
class PendingReq(Protocol):
    """What pricing reads of a request (`phaseflip.scheduler.request.Req`)."""

    rid: str
    kv_len: int

    @property
    def all_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


def device_cached_tokens(tree: Any, tokens: list[int]) -> int:
    """Length of the page-aligned prefix of `tokens` in the device radix tree, read-only."""
    return tree.cached_prefix_len(tokens) if getattr(tree, "enabled", True) else 0


@dataclass
class Pending:
    """Prefill work waiting: every token still to be fed (`raw_tokens`, an upper bound) and
    what of it is really work once residency is priced."""

    raw_tokens: int
    uncached_tokens: int | None = None  # None: not priced (the raw bound decided)
    # what residency pricing found; None when it did not run (law 5: unpriced is not 0)
    device_tokens: int | None = None  # in the device prefix tree
    host_tokens: int | None = None  # in the HiCache host tier (past the device prefix)
    shared_tokens: int | None = None  # computed first by an earlier pending request
    unpriced_tokens: int | None = None  # raw tokens of the waiting requests past the walk
    unpriced_work_tokens: int | None = None  # their work, at the priced ones' uncached share
    complete: bool = True  # False: pricing stopped at the limit or PRICE_MAX_REQUESTS

    @property
    def work_tokens(self) -> int | None:
        """The work the decision weighs: uncached tokens, plus the extrapolated tail."""
        u = self.uncached_tokens
        return None if u is None else u + (self.unpriced_work_tokens or 0)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class ResidencyPricer:
    """Counts the uncached prefill tokens of the waiting and prefilling requests."""

    def __init__(self, page_size: int, keys_of: Callable[[list[int]], list[bytes]],
                 on_host: Callable[[bytes], bool]) -> None:
        self.page_size = page_size  # HiCache page (a multiple of the device page)
        self.keys_of, self.on_host = keys_of, on_host
        self._keys: dict[str, tuple[int, list[bytes]]] = {}  # rid -> (tokens hashed, keys)

    @staticmethod
    def raw(waiting: Iterable[PendingReq], running: Iterable[PendingReq]) -> int:
        """Tokens still to feed before each request samples, decode rows excluded."""
        left = sum(r.num_tokens - r.kv_len for r in running if r.num_tokens - r.kv_len > 1)
        return left + sum(r.num_tokens for r in waiting)

    def price(self, waiting: Iterable[PendingReq], running: Iterable[PendingReq], tree: Any,
              limit: float = math.inf, max_requests: int = PRICE_MAX_REQUESTS) -> Pending:
        """Prices prefilling requests (their rest is work: admission matched their prefix
        already) then waiting ones in queue order; stops once the uncached count > `limit`,
        or after `max_requests` waiting ones (the rest: `unpriced_tokens`)."""
        waiting, running = list(waiting), list(running)
        out = Pending(self.raw(waiting, running), 0, 0, 0, 0, 0)
        claimed: set[bytes] = set()  # pages an earlier pending request computes
        for req in running:
            if req.num_tokens - req.kv_len > 1:
                out.uncached_tokens += req.num_tokens - req.kv_len
                claimed.update(self._page_keys(req, req.num_tokens))
        priced_raw = priced_work = 0  # of the waiting requests walked
        for i, req in enumerate(waiting):
            if out.uncached_tokens > limit:
                out.complete = False
                break
            if i >= max_requests:
                tail = out.unpriced_tokens = sum(r.num_tokens for r in waiting[i:])
                out.unpriced_work_tokens = round(tail * priced_work / max(1, priced_raw))
                out.complete = False
                break
            n = req.num_tokens - 1  # admission matches at most this much (the last is fed)
            keys = self._page_keys(req, n)
            dev = device_cached_tokens(tree, req.all_ids[:n])
            hp, page = self.page_size, dev // self.page_size
            host = shared = 0
            while page < len(keys):
                if self.on_host(keys[page]):
                    host += 1
                elif keys[page] in claimed:
                    shared += 1
                else:
                    break
                page += 1
            past_dev = max(0, page * hp - dev)  # pages covered from the host or a sibling
            host_t = min(past_dev, host * hp)
            out.device_tokens += dev
            out.host_tokens += host_t
            out.shared_tokens += past_dev - host_t
            out.uncached_tokens += req.num_tokens - dev - past_dev
            priced_raw += req.num_tokens
            priced_work += req.num_tokens - dev - past_dev
            claimed.update(keys)
        if len(self._keys) > 4 * (len(waiting) + len(running)) + 64:
            live = {r.rid for r in waiting} | {r.rid for r in running}
            self._keys = {k: v for k, v in self._keys.items() if k in live}
        return out

    def _page_keys(self, req: PendingReq, n: int) -> list[bytes]:
        """Keys of the full pages of `req.all_ids[:n]`, hashed once per request and length
        (a waiting request's tokens do not change)."""
        got = self._keys.get(req.rid)
        if got is None or got[0] != n:
            got = (n, self.keys_of(req.all_ids[:n]))
            self._keys[req.rid] = got
        return got[1]


# ---------------------------------------------------------------------- the policy
@dataclass
class Decision:
    """One answer of the policy: flip to `target` or stay, why, and the numbers behind it."""

    target: Layout | None
    reason: str
    numbers: dict[str, Any] = field(default_factory=dict)
    at_s: float = 0.0

    @property
    def flip(self) -> bool:
        return self.target is not None

    def as_dict(self, now_s: float) -> dict[str, Any]:
        return {"flip": self.flip,
                "target": None if self.target is None else layout_name(self.target),
                "reason": self.reason, "numbers": self.numbers,
                "seconds_ago": round(now_s - self.at_s, 3)}


class FlipPolicy:
    """Estimates fed by the engine after each step and each seam; `decide` between steps.

    `cfg`: an EngineConfig (the flip_* knobs, the launch layout); `pricer`: the residency
    pricer (None: pending tokens priced raw, for tests of the cost model alone)."""

    def __init__(self, cfg: Any, pricer: ResidencyPricer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.auto = cfg.flip_policy == "auto"
        self.decode, self.prefill = cfg.flip_layout_pair
        self.layout: Layout = (cfg.tp_size, cfg.pp_size)
        self.min_dwell_s, self.min_dwell_steps = cfg.flip_min_dwell_s, cfg.flip_min_dwell_steps
        self.served_fraction = cfg.flip_backlog_served_fraction
        self.decode_slo_ms = cfg.flip_decode_slo_ms
        self.seed_speedup = cfg.flip_seed_pp_speedup
        self.pricer, self.clock = pricer, clock
        self.rates: dict[Layout, PrefillCostModel] = {}
        # the prefill step a large backlog runs in: X and P are priced at its size, or the
        # backlog's if smaller (`step_tokens`: that of the last decision)
        chunk = cfg.chunk_size  # (the scheduler's prefill budget of a step)
        self.max_step_tokens = (min(chunk, cfg.max_prefill_tokens) if chunk else
                                cfg.max_prefill_tokens)
        self.step_tokens = self.max_step_tokens
        self.costs: dict[tuple[Layout, Layout], CostEstimator] = {
            (self.decode, self.prefill): CostEstimator(cfg.flip_seed_to_pp_s),
            (self.prefill, self.decode): CostEstimator(cfg.flip_seed_to_tp_s)}
        self.decode_ms: deque[float] = deque(maxlen=DECODE_WINDOW)
        self.decode_costs = DecodeCosts()  # every layout's, by batch (kept across seams)
        self.since_s, self.steps_in_layout = clock(), 0
        self.dwelling = False  # a dwell follows a flip (or an abandoned one), not the launch
        self.busy_s = self.since_s  # when a step last ran work (idle flips count from it)
        self._idle_asked: float | None = None  # busy_s of the idle spell last asked about
        self.flips = self.auto_flips = 0  # seams seen; those of them this policy decided
        self._asked: Layout | None = None  # the target of a flip decided, not yet seen
        self.last: Decision | None = None
        self.recent: deque[Decision] = deque(maxlen=8)  # the last flip decisions

    # ------------------------------------------------------------------ observations
    def observe_step(self, layout: Layout, prompt_tokens: int, decode_rows: int,
                     seconds: float, decode_groups: int = 1) -> None:
        """One engine step: its prompt tokens, decode rows and wall time. `decode_groups`:
        PP decode groups in flight (`--pp-async-decode`); a step then decodes one group, and a
        decoding request waits that many steps for its next token, which the decode SLO is
        about."""
        model = self.rates.setdefault(layout, PrefillCostModel(self.max_step_tokens))
        model.observe(prompt_tokens, decode_rows, seconds)  # (an idle one: run-ahead's wait)
        if prompt_tokens + decode_rows == 0:
            return  # an idle step is no step in the layout
        self.steps_in_layout += 1
        self.busy_s = self.clock()
        if decode_rows and not prompt_tokens:
            # pure decode steps only: a step that also prefills a chunk is slow for its
            # prompt, and counting it made the SLO flip back with the backlog untouched
            self.decode_ms.append(1e3 * seconds * decode_groups)
            self.decode_costs.observe(layout, decode_rows * decode_groups,
                                      1e3 * seconds * decode_groups)

    def observe_flip(self, source: Layout, target: Layout, seconds: float) -> None:
        """A seam ran (manual or automatic): its direction's cost; the dwell starts again."""
        self.costs.setdefault((source, target), CostEstimator(None)).observe(seconds)
        self.flips += 1
        self.auto_flips += self._asked == target
        self._asked = None
        self._entered(target)

    def observe_refill(self, census: Any) -> None:
        """A flip's refill window closed (`SeamCensus` refill fields): its cost joins C of that
        direction: re-prefilled tokens at the new layout's measured rate plus the load seconds.
        Nothing is observed while the new layout's rate is not measured and tokens were
        re-prefilled (law 5: a provisional rate would make C 'measured'), nor for a window
        cut short."""
        names = {layout_name(lay): lay for lay in (self.decode, self.prefill)}
        key = (names.get(census.source), names.get(census.target))
        if key not in self.costs or census.refill_tokens_prefilled is None:
            return
        seconds = 0.0
        if census.refill_tokens_prefilled:
            rate = self._rate(key[1], min(self.max_step_tokens,
                                          census.refill_tokens_prefilled))
            if rate.provenance != MEASURED:
                return
            seconds += census.refill_tokens_prefilled / rate.value
        if census.refill_bytes and census.refill_rate_gbps:
            load_s = census.refill_bytes / (census.refill_rate_gbps * 1e9)
            # the loads' own seconds are summed per load and overlap one another: the
            # window's wall time bounds them (27 loads at once on CPU summed 1.4 s in 0.32 s)
            seconds += min(load_s, census.refill_s if census.refill_s is not None else load_s)
        self.costs[key].observe_refill(seconds)

    def idle_flip_due(self) -> bool:
        """Under auto, True once an engine idle in the prefill layout should step to be asked
        (it flips back): idle --flip-min-dwell-s since its last work or flip, and not yet asked
        in this idle spell (one ask; a refused flip does not spin the loop)."""
        if not self.auto or self.layout != self.prefill or self._idle_asked == self.busy_s:
            return False
        return self.clock() - max(self.since_s, self.busy_s) >= self.min_dwell_s

    def observe_abandoned(self, reason: str) -> None:
        """An automatic flip was abandoned before any change (its fence did not complete):
        wait a dwell before trying again rather than fencing every step."""
        self.last = Decision(None, f"flip abandoned, waiting a dwell: {reason}",
                             at_s=self.clock())
        self._asked = None
        self._entered(self.layout)

    def _entered(self, layout: Layout) -> None:
        self.layout = layout
        self.dwelling = True
        self.since_s, self.steps_in_layout = self.clock(), 0
        self.busy_s = max(self.busy_s, self.since_s)
        self.decode_ms.clear()
        for model in self.rates.values():
            model.seam()

    # ------------------------------------------------------------------ estimates
    def throughputs(self, step_tokens: int | None = None) -> tuple[Estimate, Estimate]:
        """(X, P): the decode and the prefill layout's prefill tokens/s in a step of
        `step_tokens` (default: the last decision's). A seed speedup scales the measured one
        into the other ('half-measured') until both are measured (a provisional one
        included); it gives no scale alone."""
        s = self.step_tokens if step_tokens is None else step_tokens
        x, p = self._rate(self.decode, s), self._rate(self.prefill, s)
        r = self.seed_speedup
        if r is not None and x.provenance == MEASURED and p.provenance != MEASURED:
            p = Estimate(x.value * r, HALF, x.samples, "measured X × --flip-seed-pp-speedup")
        elif r is not None and p.provenance == MEASURED and x.provenance != MEASURED:
            x = Estimate(p.value / r, HALF, p.samples, "measured P / --flip-seed-pp-speedup")
        return x, p

    def _rate(self, layout: Layout, step_tokens: int) -> Estimate:
        model = self.rates.get(layout)
        return model.estimate(step_tokens) if model is not None else Estimate(None)

    def flip_costs(self) -> tuple[Estimate, Estimate]:
        """(C(decode → prefill), C(prefill → decode)): each direction its own (law 7)."""
        return (self.costs[(self.decode, self.prefill)].estimate(),
                self.costs[(self.prefill, self.decode)].estimate())

    def round_trip(self) -> Estimate:
        there, back = self.flip_costs()
        total = None if there.value is None or back.value is None else there.value + back.value
        return combine(total, there, back)

    def break_even(self) -> Estimate:
        """N = C / (1/X − 1/P) uncached prefill tokens; infinite when P ≤ X (never pays)."""
        (x, p), c = self.throughputs(), self.round_trip()
        if x.value is None or p.value is None or c.value is None:
            return combine(None, x, p, c)
        if p.value <= x.value:
            return combine(math.inf, x, p, c, note="P <= X: a flip never pays")
        return combine(c.value / (1.0 / x.value - 1.0 / p.value), x, p, c)

    def decode_step_ms(self) -> Estimate:
        if not self.decode_ms:
            return Estimate(None)
        return Estimate(sum(self.decode_ms) / len(self.decode_ms), MEASURED, len(self.decode_ms))

    # ------------------------------------------------------------------ the decision
    def decide(self, waiting: Iterable[PendingReq], running: Iterable[PendingReq],
               tree: Any) -> Decision:
        """Flip or stay, now (between two steps); the answer is kept as `last`."""
        decision = self._decide(list(waiting), list(running), tree)
        decision.at_s = self.clock()
        self.last = decision
        self._asked = decision.target
        if decision.flip:
            self.recent.append(decision)
        return decision

    def _decide(self, waiting: list, running: list, tree: Any) -> Decision:
        here = layout_name(self.layout)
        if self.layout not in (self.decode, self.prefill):
            return Decision(None, f"running {here}, not one of --flip-layouts "
                            f"{layout_name(self.decode)},{layout_name(self.prefill)}")
        raw = ResidencyPricer.raw(waiting, running)  # the step a backlog runs in, at most
        self.step_tokens = min(self.max_step_tokens, raw) if raw else self.max_step_tokens
        (x, p), n = self.throughputs(), self.break_even()
        nums: dict[str, Any] = {"X_tps": x.as_dict(), "P_tps": p.as_dict(),
                                "round_trip_s": self.round_trip().as_dict(),
                                "break_even_tokens": n.as_dict()}
        age_s = self.clock() - self.since_s
        idle = not waiting and not running  # no steps to count: the seconds alone dwell
        if self.dwelling and (age_s < self.min_dwell_s or (
                self.steps_in_layout < self.min_dwell_steps and not idle)):
            return Decision(None, f"dwell: {age_s:.1f}/{self.min_dwell_s:g} s and "
                            f"{self.steps_in_layout}/{self.min_dwell_steps} steps in {here}",
                            nums)
        if idle:
            self._idle_asked = self.busy_s  # this idle spell is answered (see idle_flip_due)
        if self.layout == self.decode:
            return self._from_decode(n, nums, waiting, running, tree)
        return self._from_prefill(n, nums, waiting, running, tree)

    def _from_decode(self, n: Estimate, nums: dict, waiting: list, running: list,
                     tree: Any) -> Decision:
        weak = [f"{name} of {layout_name(lay)} {e.note}" for name, lay, e in zip(
            "XP", (self.decode, self.prefill), self.throughputs()) if e.provisional]
        if weak:  # law 5: a rate from a lone short step flipped on background traffic
            return Decision(None, f"prefill rate not measured yet: {'; '.join(weak)}", nums)
        if n.value is None:
            return Decision(None, f"cannot price a flip: {self._missing()}", nums)
        if math.isinf(n.value):
            return Decision(None, f"{layout_name(self.prefill)} prefill is not faster than "
                            f"{layout_name(self.decode)}'s (P <= X): a flip never pays", nums)
        pending = self._pending(waiting, running, tree, n.value, nums)
        work = pending.work_tokens
        if work is None or work <= n.value:
            what = (f"{pending.raw_tokens} pending prefill tokens, cached ones included," if
                    work is None else f"{work} uncached pending prefill tokens")
            return Decision(None, f"{what} <= break-even N {n.value:.0f} ({n.provenance})",
                            nums)
        return Decision(self.prefill, f"{work}{'+' if not pending.complete else ''} uncached "
                        f"pending prefill tokens > break-even N = C/(1/X - 1/P) = "
                        f"{n.value:.0f} ({n.provenance})", nums)

    def _from_prefill(self, n: Estimate, nums: dict, waiting: list, running: list,
                      tree: Any) -> Decision:
        back = self.decode
        slo, step_ms = self.decode_slo_ms, self.decode_step_ms()
        nums["decode_step_ms"] = step_ms.as_dict()
        if slo is not None and step_ms.samples >= DECODE_WINDOW and step_ms.value > slo:
            return Decision(back, f"decode steps take {step_ms.value:.1f} ms (mean of the "
                            f"last {DECODE_WINDOW}) > --flip-decode-slo-ms {slo:g}", nums)
        if n.value is not None and math.isinf(n.value):
            return Decision(back, f"{layout_name(self.prefill)} prefill is not faster than "
                            f"{layout_name(self.decode)}'s (P <= X): nothing to win here", nums)
        served = 0.0 if n.value is None else self.served_fraction * n.value
        pending = self._pending(waiting, running, tree, served, nums)
        work = pending.work_tokens
        rule = (f"{self.served_fraction:g} x N ({n.provenance})" if n.value is not None else
                "0 (N unknown)")
        if work is None or work <= served:
            what = (f"{pending.raw_tokens} pending prefill tokens, cached ones included," if
                    work is None else f"{work} uncached pending prefill tokens")
            versus = self.decode_costs.compare(self.prefill, back, len(running) or None)
            if versus is not None:
                nums["decode_here_vs_back"] = versus.as_dict()
                if versus.here_faster:  # the premise of going back is false here
                    return Decision(None, f"prefill backlog served, but "
                                    f"{layout_name(self.prefill)} decodes faster than "
                                    f"{layout_name(back)}: {versus.here_ms:.1f} against "
                                    f"{versus.there_ms:.1f} ms a step at {versus.rows} rows "
                                    "(measured): staying", nums)
            return Decision(back, f"prefill backlog served: {what} <= {served:.0f} = {rule}",
                            nums)
        return Decision(None, f"prefill backlog: {work}{'+' if not pending.complete else ''} "
                        f"uncached pending tokens > {served:.0f} = {rule}", nums)

    def _pending(self, waiting: list, running: list, tree: Any, limit: float,
                 nums: dict) -> Pending:
        """The pending work, priced by residency only when the raw count could cross
        `limit` (it is an upper bound of the uncached count)."""
        raw = ResidencyPricer.raw(waiting, running)
        if raw <= limit:
            pending = Pending(raw)  # at most `limit` either way: no need to hash or walk
        elif self.pricer is None:
            pending = Pending(raw, raw)
        else:
            pending = self.pricer.price(waiting, running, tree, limit)
        nums["pending"] = pending.as_dict()
        return pending

    def _missing(self) -> str:
        (x, p), (there, back) = self.throughputs(), self.flip_costs()
        parts = [f"prefill throughput of {layout_name(lay)} unmeasured" for lay, e in
                 ((self.decode, x), (self.prefill, p)) if e.value is None]
        if parts and x.value is None and p.value is None and self.seed_speedup is not None:
            parts.append("(--flip-seed-pp-speedup scales a measured one: no prefill step yet)")
        elif parts and self.seed_speedup is None:
            parts.append("(no --flip-seed-pp-speedup)")
        for name, e, flag in (("→", there, "--flip-seed-to-pp-s"),
                              ("←", back, "--flip-seed-to-tp-s")):
            if e.value is None:
                parts.append(f"flip cost {layout_name(self.decode)} {name} "
                             f"{layout_name(self.prefill)} unmeasured (no {flag})")
        return "; ".join(parts)

    # ------------------------------------------------------------------ report
    def snapshot(self) -> dict[str, Any]:
        """Everything an operator needs to see why the policy did or did not flip
        (`/server_info` → `flip_policy`)."""
        (x, p), (there, back) = self.throughputs(), self.flip_costs()
        now = self.clock()
        return {
            "policy": "auto" if self.auto else "manual",
            "layouts": {"decode": layout_name(self.decode),
                        "prefill": layout_name(self.prefill)},
            "layout": layout_name(self.layout),
            "in_layout": {"seconds": round(now - self.since_s, 3),
                          "steps": self.steps_in_layout},
            "dwell": {"min_s": self.min_dwell_s, "min_steps": self.min_dwell_steps},
            "estimates": {
                "prefill_tps": {"X": x.as_dict(), "P": p.as_dict()},
                "flip_cost_s": {"to_prefill": there.as_dict(), "to_decode": back.as_dict()},
                "round_trip_s": self.round_trip().as_dict(),
                "break_even_tokens": self.break_even().as_dict(),
                "decode_step_ms": self.decode_step_ms().as_dict(),
                "prefill_step_tokens": self.step_tokens,  # the step X and P are priced at
                "prefill_step_fit": {name: m.describe() if m is not None else None
                                     for name, m in (("X", self.rates.get(self.decode)),
                                                     ("P", self.rates.get(self.prefill)))},
            },
            "flips": self.flips, "auto_flips": self.auto_flips,
            "last_decision": None if self.last is None else self.last.as_dict(now),
            "recent_flips": [d.as_dict(now) for d in self.recent],
        }
