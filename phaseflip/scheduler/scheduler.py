"""The one decider: which requests run this step, how many tokens each, and where their KV goes.

Every step it (1) secures one KV slot for every decoding request, retracting the newest
requests when the pool is exhausted, (2) continues partially prefilled requests and (3) admits
waiting ones under the prefill token budget (none while a partially prefilled request finds no
room for its next chunk: newer requests would take the room it waits for). The result is a
`ScheduledBatch`: a forward plan plus the bookkeeping needed to apply the sampled tokens
afterwards.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from phaseflip.config import EngineConfig
from phaseflip.forward_batch import ForwardBatch
from phaseflip.scheduler.kv_cache import KVCacheManager
from phaseflip.scheduler.request import Req

if TYPE_CHECKING:
    from phaseflip.scheduler.hicache import HiCache


def longest_output_first(max_new_tokens: list[int]) -> list[int]:
    """Indices of a batch submitted at once, longest `max_new_tokens` first (stable): the batch
    ends with its last request, and one with a long output admitted late sets that step
    (LPT order). FCFS admission follows the order of submission."""
    return sorted(range(len(max_new_tokens)), key=lambda i: -max_new_tokens[i])


@dataclass(eq=False)
class Scheduled:
    """One request's part of a step: it extends `extend_len` tokens from `start`."""

    req: Req
    start: int
    extend_len: int
    logit_row: int  # first row of this request in the logits matrix, or -1
    num_logit_rows: int
    samples: bool  # whether the last logits row is used to sample a token


@dataclass
class ScheduledBatch:
    plan: ForwardBatch
    items: list[Scheduled]


@dataclass
class SchedulerStats:
    steps: int = 0
    retractions: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCacheManager | None, max_context: int) -> None:
        self.cfg, self.kv = cfg, kv
        self.max_context = max_context
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # admission order; the newest is retracted first
        self.stats = SchedulerStats()
        self._hold_admission_at: int | None = None
        self.hicache: HiCache | None = None  # with the host/disk tiers on (`bind`)

    def bind(self, kv: KVCacheManager | None, hicache: HiCache | None) -> None:
        """The layout this scheduler decides for: its KV manager and HiCache binding (both
        None between the two layouts of a phase flip). Queues and stats carry over."""
        self.kv, self.hicache = kv, hicache

    # ------------------------------------------------------------------ queue
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Requests to run, or HiCache transfers to retire (so idle means nothing in flight)."""
        return bool(self.waiting or self.running or (self.hicache and self.hicache.busy))

    def remove(self, req: Req) -> None:
        """Takes a request out of the scheduler, returning its KV (finish or abort)."""
        if req in self.running:
            self.kv.release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        hc = self.hicache
        if hc is not None:
            hc.forget(req)
            hc.publish_pending()
            if not self.running and not self.waiting:
                hc.quiesce()  # the last request left: nothing waits on the transfers now

    # ------------------------------------------------------------------ schedule
    def schedule(self, decode_groups: int = 1) -> ScheduledBatch | None:
        """`decode_groups` > 1 (PP decode groups in flight, `EngineCore`): at most a
        1/decode_groups share of the running requests decodes in this step."""
        hc = self.hicache
        if hc is None:
            return self._schedule(decode_groups)
        hc.begin_step()
        try:
            return self._schedule(decode_groups)
        finally:
            hc.end_step()

    def _schedule(self, decode_groups: int = 1) -> ScheduledBatch | None:
        decoding = self._secure_decode_slots(decode_groups)
        items: list[Scheduled] = []
        budget = self._prefill_budget()
        if not self.kv.allocate_decode(decoding):
            raise RuntimeError(f"no KV slots for {len(decoding)} decoding requests after "
                               f"securing them ({self.kv.accounting(self.running)})")
        items += [self._extend(r, 1) for r in decoding]
        prefill = False  # whether `items` holds prompt tokens yet (decode items never do)
        starved = False  # a running request's next chunk found no room
        for req in self.running:
            if req.remaining > 1:
                n = self._chunk(req, budget, first=not prefill)
                if n == 0:
                    break
                if self.kv.allocate(req, n) is None:
                    starved = True
                    break
                items.append(self._extend(req, n))
                prefill = True  # more than one token, or (n == 1) not yet sampling
                budget -= n
        if not starved:  # else newer requests would take the room it waits for, for ever
            self._admit(items, budget, prefill)
        # nothing else can run: waiting on the transfers is free, unless a run-ahead step's
        # tokens are still to be turned into outputs (a request they finish would wait)
        if not items and self.hicache is not None and self.hicache.busy \
                and not any(r.pending or r.launched for r in self.running):
            self.hicache.quiesce()
            if not starved:
                self._admit(items, budget, False)
        if not items:
            return None
        self.stats.steps += 1
        return self._build(items)

    def _prefill_budget(self) -> int:
        chunk = self.cfg.chunk_size
        return min(chunk, self.cfg.max_prefill_tokens) if chunk else self.cfg.max_prefill_tokens

    def _chunk(self, req: Req, budget: int, first: bool) -> int:
        """Tokens of `req` to prefill this step: all of them when they fit the budget; a chunk
        when chunking is on; everything if it is the step's first prefill and chunking is off
        (a prompt larger than the budget must still run, alone)."""
        if req.remaining <= budget:
            return req.remaining
        if self.cfg.chunk_size:
            return max(0, budget)
        return req.remaining if first else 0

    def _secure_decode_slots(self, groups: int = 1) -> list[Req]:
        """Ensures every decoding request of this step gets its next slot, retracting
        newest-first; returns them. (A request in a launched, unsampled step has
        `remaining` 0: it is not decoding.)"""
        max_context = self.max_context
        while True:
            decoding = [r for r in self.running if r.remaining == 1
                        and not (r.pending and r.ends_with_pending(max_context))]
            if groups > 1:
                decoding = self._decode_group(decoding, groups)
            pages = self.kv.decode_pages(decoding)
            if pages * self.kv.page_size <= self.kv.available() or not self.running:
                return decoding
            if len(self.running) == 1:
                raise RuntimeError(
                    f"request {self.running[0].rid} alone does not fit the KV pool "
                    f"({self.kv.accounting(self.running)})"
                )
            self._retract(self.running[-1])

    def _decode_group(self, decoding: list[Req], groups: int) -> list[Req]:
        """At most ceil(running / groups) of `decoding`, those whose last token is on the host
        first (they were left out of an earlier step), in running order. The groups form by
        themselves: the requests of a launched step are not decoding until it is sampled."""
        cap = -(-len(self.running) // groups)
        if len(decoding) <= cap:
            return decoding
        chosen = set(sorted(decoding, key=lambda r: r.pending)[:cap])
        return [r for r in decoding if r in chosen]

    def _retract(self, req: Req) -> None:
        self.kv.release(req)
        if self.hicache is not None:
            self.hicache.publish_pending()
        self.running.remove(req)
        req.retractions += 1
        self.stats.retractions += 1
        self.waiting.appendleft(req)
        self._hold_admission_at = len(self.running)

    def retract_all(self) -> int:
        """Takes every running request off the device, newest first, so they wait at the front
        of the queue in admission order (the phase flip's retract); returns how many."""
        n = len(self.running)
        while self.running:
            self._retract(self.running[-1])
        self._hold_admission_at = None  # nothing to protect: the next steps re-admit them all
        return n

    def _admission_order(self) -> list[Req]:
        policy = self.cfg.schedule_policy
        if policy == "lpm" and self.kv.tree.enabled and len(self.waiting) > 1:
            def cached(r: Req) -> int:
                return -int(self.kv.tree.match_prefix(r.all_ids[:-1]).slots.numel())
            return sorted(self.waiting, key=lambda r: (cached(r), r.arrival))
        if policy == "lof" and len(self.waiting) > 1:  # see longest_output_first
            return sorted(self.waiting, key=lambda r: (-r.remaining_output, r.arrival))
        return list(self.waiting)

    def _admit(self, items: list[Scheduled], budget: int, prefill: bool) -> None:
        """Admits waiting requests while they fit; `prefill`: `items` already holds prompt
        tokens. The decode reserve is summed once and grown by each admission (it is read per
        candidate, and summing it over every running request each time is O(running²))."""
        if self._hold_admission_at is not None:
            if len(self.running) >= self._hold_admission_at and self.running:
                return
            self._hold_admission_at = None
        reserve = None
        for req in self._admission_order():
            if len(self.running) >= self.cfg.max_running_requests or budget <= 0 and (
                prefill or self.cfg.chunk_size
            ):
                return
            if self._waits_for_leader(req) or req.pending or req.launched or req.compiling:
                continue  # (a retracted request whose last token is still on the device)
            limit = req.prompt_lp_next if req.wants_prompt_logprobs else req.num_tokens - 1
            if self.hicache is not None and self.kv.table.free_rows and not self._prefetch(
                req, limit
            ):
                continue  # its cached pages are on their way: admit others meanwhile
            if not self.kv.admit(req, limit):
                return
            n = self._chunk(req, budget, first=not prefill)
            if reserve is None:
                reserve = self.decode_reserve()
            fits = n > 0 and self.kv.pages_needed(req, n) * self.kv.page_size + reserve <= (
                self.kv.available()
            )
            if not fits or self.kv.allocate(req, n) is None:
                self._unadmit(req)
                return
            if self.hicache is not None:  # (after the fit: a try that failed is no admission)
                self.hicache.admitted(req)
            self.waiting.remove(req)
            self.running.append(req)
            reserve += self.kv.pages_needed(req, 1) * self.kv.page_size
            prefill = prefill or n > 1 or req.kv_len + n < req.num_tokens
            if not req.admitted_once:
                req.cached_tokens = req.kv_len
                self.stats.cached_tokens += req.kv_len
                req.admitted_once = True
            items.append(self._extend(req, n))
            budget -= n

    def _unadmit(self, req: Req) -> None:
        """Undoes `kv.admit` of a request that did not fit: it waits holding nothing, and the
        hold of its HiCache load goes too (a waiting request pins no pages)."""
        self.kv.release(req)
        if self.hicache is not None:
            self.hicache.unhold(req)

    def _prefetch(self, req: Req, limit: int) -> bool:
        """Whether `req` may be admitted: its host/disk pages (if any) are in the tree. A load
        leaves the running requests their next decode slots."""
        return self.hicache.prefetch(req, req.all_ids[:limit], self.decode_reserve())

    def decode_reserve(self) -> int:
        """Slots the running requests' next decode tokens may need (whole new pages)."""
        return self.kv.decode_pages(self.running) * self.kv.page_size

    def _waits_for_leader(self, req: Req) -> bool:
        """Samples of an n > 1 group wait until the leader's prompt is in the prefix tree."""
        lead = req.leader
        if lead is None or not self.kv.tree.enabled or lead.finished:
            return False
        return lead.kv_len < len(lead.prompt_ids) or lead not in self.running

    # ------------------------------------------------------------------ plan
    def _extend(self, req: Req, n: int) -> Scheduled:
        """The step's part of `req` (its slots are already allocated). Logits are taken for
        every new token when prompt logprobs are wanted, else for the last one if it samples."""
        start = req.kv_len
        samples = start + n == req.num_tokens and req.params.max_new_tokens > 0
        rows = n if req.wants_prompt_logprobs else int(samples)
        return Scheduled(req, start, n, -1, rows, samples)

    def _build(self, items: list[Scheduled]) -> ScheduledBatch:
        ids: list[int] = []
        logit_idx: list[int] = []
        offset = 0
        decode_tokens = 0
        for it in items:
            req, s, n = it.req, it.start, it.extend_len
            if n == 1 and it.num_logit_rows == 1:  # a decode row (most rows of most steps)
                ids.append(req.token(s))
                it.logit_row = len(logit_idx)
                logit_idx.append(offset)
                offset += 1
                if req.kv_len < req.num_tokens - 1:
                    self.stats.prefill_tokens += 1
                else:
                    decode_tokens += 1
                continue
            ids += req.tokens(s, s + n)
            if it.num_logit_rows:
                it.logit_row = len(logit_idx)
                logit_idx += range(offset + n - it.num_logit_rows, offset + n)
            offset += n
            if n > 1 or req.kv_len < req.num_tokens - 1:
                self.stats.prefill_tokens += n
            else:
                decode_tokens += n
        self.stats.decode_tokens += decode_tokens
        plan = ForwardBatch.from_table(
            self.kv.table.table, [it.req.row for it in items], [it.start for it in items],
            [it.extend_len for it in items], ids, logit_idx, self.kv.table.epochs)
        return ScheduledBatch(plan, items)

    # ------------------------------------------------------------------ after the forward
    def advance(self, batch: ScheduledBatch) -> None:
        """Marks the planned tokens as computed and publishes finished prefill chunks."""
        for it in batch.items:
            req = it.req
            req.kv_len += it.extend_len
            if it.extend_len > 1 or req.kv_len <= len(req.prompt_ids):
                # a prefill chunk: share it at once (n > 1 samples wait for exactly this)
                self.kv.cache_unfinished(req)
        if self.hicache is not None:
            self.hicache.publish_pending()  # write-through: store orders this very step

