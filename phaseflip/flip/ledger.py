"""What a phase flip costs after its cutover (docs/design.md): the refill of the requests retracted
at the seam, completed in the seam census, and the warm-up ledger of served latency.

The engine's flip observer (`flip/telemetry.py`) feeds a `FlipLedger` when flips are on:
`before_seam` with the running requests just before a seam, `cutover` with the seam census
right after it, `observe_items` with each step's scheduled items (after `Scheduler.advance`)
and `observe_step` at each step's end.
Bookkeeping only: nothing here waits, copies or reads the device.

Refill. A request retracted at the seam (running just before it, holding `kv_len` = B tokens
of KV) is *refilled* once a step after the cutover leaves its `kv_len` ≥ B: it was
re-admitted, its prefix matched in the prefix cache (pages read back from the host tier) and
the rest re-prefilled, maybe in chunks or after another retraction. The refill window runs
from the cutover to the end of the step that refills the last of them; a request that ends
meanwhile (aborted, or too big for the new pool) is no longer waited for. When it closes, the
census gets (law 5: every field None while the window is open; `refill_state` says why):
- `refill_tokens_prefilled`: tokens below B that the window's steps computed again for them
  (over their scheduled items, the part of [start, start + n) below B).
- `refill_tokens_loaded`, `refill_bytes`: what the HiCache controller loaded host → device
  in the window (host and disk hit tokens, bytes; loads are counted when their pages join
  the tree). A retracted request is admitted only once its pages are in the tree, so all its
  loads fall inside the window; the retracted requests head the queue, but a load for a
  request admitted after them in the same window is counted too. None without a host tier.
- `refill_rate_gbps`: those bytes / the loads' own seconds (dispatch to seen in the tree,
  summed per load: a floor of the link, as `HiCacheStats.load_gbps`); None when none loaded.
- `refill_s`: cutover → the end of the step that refilled the last of them (0 when nothing
  was retracted). A window the next flip cuts short stays None (`refill_state` "cut short").

Warm-up ledger. Served latency is the inter-token latency running requests see: the wall time
of a step that samples a next token for a request that already has output (a decode row, or a
retracted request's re-prefill, which is exactly where the warm-up shows). A *round* is a step
that ran a batch; round 1 is the first after the cutover. Each flip's `Warmup` keeps the mean
served latency per band of rounds since the cutover — ≤1, ≤4, ≤16, ≤64 (the rounds 1, 2–4,
5–16, 17–64) and "steady" beyond 64 — and reports it as a ratio to the layout's steady state:
this flip's own steady band once it holds STEADY_MIN_STEPS served steps, until then the steady
mean the same layout reached in its previous tenure (the launch layout's first tenure counts).
A band that served no step, or has no reference yet, is None. The last RECENT_FLIPS censuses,
each with its refill and warm-up, are kept for `/server_info` (`last_flip`, `flip_censuses`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phaseflip.flip.census import SeamCensus
    from phaseflip.scheduler.request import Req
    from phaseflip.scheduler.scheduler import Scheduled

log = logging.getLogger("phaseflip.engine.flip")

BAND_EDGES = (1, 4, 16, 64)  # the last round of each warm-up band; beyond the last: steady
BANDS = ("≤1", "≤4", "≤16", "≤64", "steady")
STEADY_MIN_STEPS = 8  # served steps in the steady band before it is this flip's reference
RECENT_FLIPS = 4  # censuses kept for /server_info


def band_of(rounds: int) -> str:
    """The warm-up band of the `rounds`-th round since the cutover (1-based)."""
    for edge, name in zip(BAND_EDGES, BANDS):
        if rounds <= edge:
            return name
    return BANDS[-1]


class Warmup:
    """Served latency of one tenure of a layout (from a cutover, or the launch) by band."""

    def __init__(self, layout: str, earlier_steady_ms: float | None = None) -> None:
        self.layout = layout
        self.earlier_steady_ms = earlier_steady_ms  # the layout's steady mean before, if any
        self.rounds = 0
        self.steps = dict.fromkeys(BANDS, 0)  # served steps per band
        self.seconds = dict.fromkeys(BANDS, 0.0)

    def observe(self, ran: bool, served: bool, seconds: float) -> None:
        """One engine step: whether it ran a batch, whether it served a next token."""
        if not ran:
            return
        self.rounds += 1
        if served:
            band = band_of(self.rounds)
            self.steps[band] += 1
            self.seconds[band] += seconds

    def mean_ms(self, band: str) -> float | None:
        n = self.steps[band]
        return 1e3 * self.seconds[band] / n if n else None

    def steady_ms(self) -> float | None:
        """This tenure's steady mean, once it has enough served steps to be one."""
        return self.mean_ms("steady") if self.steps["steady"] >= STEADY_MIN_STEPS else None

    def reference(self) -> tuple[float | None, str | None]:
        own = self.steady_ms()
        if own is not None:
            return own, "this tenure"
        if self.earlier_steady_ms is not None:
            return self.earlier_steady_ms, "earlier tenure"
        return None, None

    def as_dict(self) -> dict[str, Any]:
        ref, source = self.reference()
        bands = {}
        for band in BANDS:
            mean = self.mean_ms(band)
            bands[band] = {"steps": self.steps[band], "mean_ms": mean,
                           "ratio": None if mean is None or not ref else mean / ref}
        return {"layout": self.layout, "rounds": self.rounds, "reference_ms": ref,
                "reference": source, "bands": bands}


class Refill:
    """The refill window of one flip: completes its census's refill fields in place."""

    def __init__(self, census: SeamCensus, before: list[tuple[Req, int]], hicache: Any,
                 now: float) -> None:
        self.census, self.hicache, self.t0 = census, hicache, now
        self.waiting: dict[int, tuple[Req, int]] = {id(r): (r, b) for r, b in before}
        self.loads0 = _loads(hicache)
        self.prefilled = 0
        census.refill_state = "pending"

    def observe_items(self, items: Iterable[Scheduled]) -> None:
        """A step's items, after `advance` (kv_len counts the step's tokens)."""
        for it in items:
            got = self.waiting.get(id(it.req))
            if got is None:
                continue
            req, before = got
            self.prefilled += max(0, min(it.start + it.extend_len, before) - it.start)
            if req.kv_len >= before:
                del self.waiting[id(req)]

    def settle(self, now: float) -> bool:
        """At a step's end: closes the window once no retracted request is left unrefilled
        (ended ones are not waited for). True when closed."""
        for key in [k for k, (req, _) in self.waiting.items() if req.finished]:
            del self.waiting[key]
        if self.waiting:
            return False
        c, loads = self.census, _loads(self.hicache)
        c.refill_tokens_prefilled, c.refill_s = self.prefilled, now - self.t0
        if loads is not None and self.loads0 is not None:
            tokens, nbytes, seconds = (a - b for a, b in zip(loads, self.loads0))
            c.refill_tokens_loaded, c.refill_bytes = int(tokens), int(nbytes)
            c.refill_rate_gbps = nbytes / seconds / 1e9 if nbytes and seconds > 0 else None
        c.refill_state = "done"
        log.info(c.refill_line())
        return True

    def cut_short(self) -> None:
        self.census.refill_state = "cut short"


def _loads(hicache: Any) -> tuple[float, float, float] | None:
    """(tokens, bytes, seconds) the HiCache controller has loaded so far; None without one."""
    if hicache is None:
        return None
    s = hicache.stats
    return s.host_hit_tokens + s.disk_hit_tokens, s.bytes_loaded, s.load_seconds


class FlipLedger:
    """The refill and warm-up of every flip, fed by the engine (see the module docstring)."""

    def __init__(self, layout: str, clock=time.perf_counter,
                 on_refill: Callable[[SeamCensus], None] | None = None) -> None:
        self.clock = clock
        self.on_refill = on_refill  # told each refill window that closes (the policy's C)
        self.tenure = Warmup(layout)  # the layout running now, since the launch or a cutover
        self.steady_ms: dict[str, float] = {}  # per layout: its last tenure's steady mean
        self.recent: deque[SeamCensus] = deque(maxlen=RECENT_FLIPS)
        self.refill: Refill | None = None
        self._before: list[tuple[Req, int]] = []
        self._served = False

    def before_seam(self, running: Iterable[Req]) -> None:
        """The requests a seam is about to retract, with the KV each holds."""
        self._before = [(r, r.kv_len) for r in running]

    def cutover(self, census: SeamCensus, hicache: Any) -> None:
        """A seam ended: a new tenure of `census.target` starts; its refill window opens."""
        if self.refill is not None:
            self.refill.cut_short()
        steady = self.tenure.steady_ms()
        if steady is not None:
            self.steady_ms[self.tenure.layout] = steady
        self.tenure = census.warmup = Warmup(census.target, self.steady_ms.get(census.target))
        self.recent.append(census)
        now = self.clock()
        self.refill = Refill(census, self._before, hicache, now)
        self._before = []
        self._settle(now)  # nothing was retracted (or all ended): nothing to refill

    def observe_items(self, items: list[Scheduled]) -> None:
        """A step's scheduled items, after `Scheduler.advance`, before sampling."""
        self._served |= any(it.samples and it.req.output_ids for it in items)
        if self.refill is not None:
            self.refill.observe_items(items)

    def observe_step(self, ran: bool, seconds: float) -> None:
        """A step's end: whether it ran a batch, its wall time."""
        served, self._served = self._served, False
        self.tenure.observe(ran, served, seconds)
        if self.refill is not None:
            self._settle(self.clock())

    def _settle(self, now: float) -> None:
        if self.refill is not None and self.refill.settle(now):
            census, self.refill = self.refill.census, None
            if self.on_refill is not None:
                self.on_refill(census)

    def snapshot(self) -> dict[str, Any]:
        """`/server_info`: the last flip's census (refill and warm-up included) and the last
        RECENT_FLIPS, oldest first."""
        recent = [c.as_dict() for c in self.recent]
        return {"last_flip": recent[-1] if recent else None, "flip_censuses": recent}
