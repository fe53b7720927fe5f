"""The HiCache controller's load path (`scheduler.hicache`): which pages a waiting request loads,
their promotion from disk into host frames, the host->device copy into fresh slots, and their
insertion into the radix tree once visible. Kept apart from the stores so each side's state
(and the invariants on it) can be read whole; the controller owns the tiers and the layout and
hands this path what it needs.

A load's pages stay pinned in the host tier from the prefetch that chose them (or from landing)
until its copy is done, so a burst's later promotions cannot evict them unread. A promotion that
fails (a miss, a bad page, or an I/O thread that raised) ends the load at that page: the pages
before it load, the rest are computed again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from phaseflip.cache.hicache import HostPagePool, TransferOrders
from phaseflip.cache.hicache.disk_io import DiskIO
from phaseflip.cache.hicache.transfer import TransferChannel
from phaseflip.scheduler.hicache_state import COPYING, LOADED, PROMOTING, LoadJob
from phaseflip.scheduler.kv_cache import KVCacheManager
from phaseflip.scheduler.request import Req

FRAME_WAITS = 8
"""Admission tries a request whose next page is on disk waits for a host frame, then computes."""


class LoadPath:
    """Every load of the controller: its jobs, their promotions and their holds."""

    def __init__(self, host: HostPagePool, io: DiskIO | None, page_size: int, page_bytes: int,
                 keys: Callable[[list[int]], list[bytes]], count: Callable[..., None],
                 busy: Callable[[], bool]) -> None:
        """`keys`, `count` and `busy` are the controller's: page keys of a token list, its stats
        counter, and whether anything (stores included) is in flight, which decides whether a
        request that finds no host frame may wait for one."""
        self.host, self.io, self.page_size, self.page_bytes = host, io, page_size, page_bytes
        self._keys, self._count, self._busy = keys, count, busy
        self.jobs: list[LoadJob] = []
        self.of: dict[str, LoadJob] = {}  # request id -> its load in progress
        self.loading: dict[bytes, LoadJob] = {}  # first page key -> load (one load per page)
        self.promoting: dict[bytes, Future[bool]] = {}
        self._missed: set[str] = set()  # waiting requests whose prefix stopped at a miss
        self._frame_waits: dict[str, int] = {}  # rid -> admission tries that found no frame
        # the scheduler's current decode reserve in slots (set by the engine; None: none)
        self.decode_reserve: Callable[[], int] | None = None
        self.kv: KVCacheManager | None = None
        self.tree: Any = None
        self.channel: TransferChannel | None = None

    def bind(self, kv: KVCacheManager, channel: TransferChannel) -> None:
        """Attach to a layout; misses and frame waits were judged against an earlier tree."""
        self.kv, self.tree, self.channel = kv, kv.tree, channel
        self._missed.clear()
        self._frame_waits.clear()

    def unbind(self) -> None:
        self.kv, self.tree, self.channel = None, None, None

    # ------------------------------------------------------------------ queries
    def pending(self) -> dict[str, int]:
        """What ties this path to the bound layout (a bind or unbind needs none)."""
        return {name: len(v) for name, v in (
            ("loads", self.jobs), ("load_of", self.of), ("loading", self.loading),
            ("promoting", self.promoting)) if v}

    @property
    def busy(self) -> bool:
        return bool(self.promoting or any(j.state != LOADED or j.frames for j in self.jobs))

    @property
    def pages_in_flight(self) -> int:
        return sum(len(j.keys) for j in self.jobs if j.state != LOADED)

    @property
    def in_flight_slots(self) -> int:
        """Device slots held by loads not yet in the tree (outside the pool's four classes)."""
        return sum(int(j.slots.numel()) for j in self.jobs
                   if j.state == COPYING and j.slots is not None)

    # ------------------------------------------------------------------ step hooks
    def land(self) -> None:
        """Retire the promotions that ended. One whose I/O thread raised (not a miss: a crash)
        ends as failed before the error goes on, so the loads waiting on it do not stay
        PROMOTING with their pages pinned, should the engine survive it."""
        for key, fut in list(self.promoting.items()):
            if fut.done():
                del self.promoting[key]
                try:
                    ok = fut.result()
                except BaseException:
                    self._landed(key, False)
                    raise
                self._landed(key, ok)

    def advance_all(self) -> None:
        for job in list(self.jobs):
            self._advance(job)

    def end_step(self) -> None:
        """Loaded pages lose their hold once the step that could admit their request is over
        (then they are ordinary cached prefixes); finished jobs are dropped."""
        for job in list(self.jobs):
            if job.state != LOADED:
                continue
            if job.hold is not None:
                self.tree.dec_lock_ref(job.hold)
                job.hold = None
            if not job.frames:
                self._drop(job)

    # ------------------------------------------------------------------ requests
    def prefetch(self, req: Req, tokens: list[int], spare_tokens: int) -> bool:
        """True when `req` may be admitted now (nothing to load, or its pages are visible in
        the tree). False while its pages are on their way: admit other requests meanwhile.
        `spare_tokens`: slots a load must leave to the running requests."""
        job = self.of.get(req.rid)
        if job is not None:
            return job.state == LOADED
        self._missed.discard(req.rid)  # a miss of an earlier try that did not admit it
        hp = self.page_size
        first = int(self.tree.match_prefix(tokens).slots.numel()) // hp
        if first >= len(tokens) // hp:
            return True  # every full page is on the device already: nothing to hash or load
        keys = self._keys(tokens)
        if keys[first] in self.loading:
            return False  # another request is loading these very pages: wait for them
        job = LoadJob(tokens=[], start=first * hp, keys=[], base=None, spare_tokens=spare_tokens)
        found = self._choose(req, job, keys[first:])
        if not job.keys:
            return not (found is None and self._wait_for_frame(req))
        job.tokens = tokens[: job.start + len(job.keys) * hp]
        job.base = self.tree.match_prefix(tokens[: job.start]).last_node
        self.tree.inc_lock_ref(job.base)
        self.jobs.append(job)
        self.of[req.rid] = job
        self.loading[job.keys[0]] = job
        self._advance(job)
        return job.state == LOADED

    def _choose(self, req: Req, job: LoadJob, keys: list[bytes]) -> bool | None:
        """Add to `job` the leading `keys` some tier can serve; what `_available` said of the
        first it could not (None: no host frame for a disk page)."""
        found: bool | None = True
        for key in keys:
            found = self._available(key, job)
            if not found:
                if found is not None:
                    self._missed.add(req.rid)  # counted once, when the request is admitted
                break
            job.keys.append(key)
        return found

    def _wait_for_frame(self, req: Req) -> bool:
        """A disk page with no host frame free: while loads and stores in flight hold the
        frames (they let go within steps) the request waits rather than recompute it,
        FRAME_WAITS tries at most (write-back's cleaner can take every frame each step)."""
        waits = self._frame_waits.get(req.rid, 0)
        if self._busy() and waits < FRAME_WAITS:
            self._frame_waits[req.rid] = waits + 1
            return True
        return False

    def admitted(self, req: Req) -> None:
        """`req` was admitted and locks its prefix itself: a miss its prefetch met is counted
        (once an admission, not once a try), and its load's hold is no longer needed."""
        self._frame_waits.pop(req.rid, None)
        if req.rid in self._missed:
            self._missed.discard(req.rid)
            self._count(miss_pages=1)
        self.unhold(req)

    def unhold(self, req: Req) -> None:
        """Drops the hold of `req`'s load, if any: its pages stay in the tree."""
        job = self.of.pop(req.rid, None)
        if job is not None and job.hold is not None:
            self.tree.dec_lock_ref(job.hold)
            job.hold = None

    def forget(self, req: Req) -> None:
        """`req` left the queue; its load (if any) still completes into the tree."""
        self.of.pop(req.rid, None)
        self._missed.discard(req.rid)
        self._frame_waits.pop(req.rid, None)

    # ------------------------------------------------------------------ one load
    def _available(self, key: bytes, job: LoadJob) -> bool | None:
        """Whether `job` can load page `key`: pinned for it now (host tier) or when it lands
        (disk). None: on disk, but no host frame can take it now (all pinned or reserved)."""
        if self.host.acquire_frame(key) is not None:
            job.pinned.add(key)
            return True
        if key not in self.promoting:
            if self.io is None or not self.io.disk.contains(key):
                return False
            fut = self.io.promote(key)
            if fut is None:
                return None
            self.promoting[key] = fut
        job.promoting.add(key)
        return True

    def _landed(self, key: bytes, ok: bool) -> None:
        """A promotion ended: if the page landed (pinned once, for the controller), every load
        waiting on it gets a pin of its own, then the promotion's goes."""
        for job in self.jobs:
            if key in job.promoting:
                job.promoting.discard(key)
                if ok:
                    self.host.pin(key)
                    job.pinned.add(key)
                    job.from_disk.add(key)
        if ok:
            self.host.unpin(key)

    def _advance(self, job: LoadJob) -> None:
        if job.state == PROMOTING:
            if job.promoting:
                return
            self._start_copy(job)
        if job.state == COPYING and self.channel.visible(job.ticket):
            self._insert(job)
        if job.frames and job.ticket is not None and self.channel.done(job.ticket):
            for key in job.keys:
                self.host.unpin(key)
            job.frames = []

    def _start_copy(self, job: LoadJob) -> None:
        """Allocate the slots of the pinned pages up to the first failed promotion, dispatch
        the host->device copies; the pins of pages not loaded go."""
        hp = self.page_size
        self._take_frames(job)
        alloc = self.kv.allocator
        # the reserve as of now: a load promoted from disk may start many steps after prefetch
        spare = max(job.spare_tokens, self.decode_reserve() if self.decode_reserve else 0)
        room = alloc.free_slots + self.tree.evictable_size() - spare
        n = min(len(job.frames), max(0, room) // hp)
        job.keys, job.frames = job.keys[:n], job.frames[:n]
        for key in job.pinned.difference(job.keys):
            self.host.unpin(key)
        if n and alloc.free_slots < n * hp:
            self.tree.evict(n * hp - alloc.free_slots)
        slots = alloc.alloc_slots(n * hp // self.kv.page_size) if n else None
        if slots is None:
            for key in job.keys:
                self.host.unpin(key)
            job.keys, job.frames = [], []
            self._finish(job)
            return
        job.slots = slots
        job.state = COPYING
        orders = TransferOrders(load_frames=list(job.frames), load_slots=list(slots.split(hp)))
        job.ticket = self.channel.dispatch(orders)
        job.dispatched = time.perf_counter()

    def _take_frames(self, job: LoadJob) -> None:
        """The host frames of `job`'s pinned pages, up to the first page not pinned."""
        for key in job.keys:
            # a page that failed to promote may have come into the host tier since (a store
            # of the same prefix): a host hit then, never counted as read from disk
            if key not in job.pinned and self.host.acquire_frame(key) is not None:
                job.pinned.add(key)
            if key not in job.pinned:
                break  # load up to here
            job.frames.append(self.host.frame_of(key))

    def _insert(self, job: LoadJob) -> None:
        """The loaded pages join the tree under their (locked) prefix; `job.slots` now belong
        to the tree, except duplicates of pages another request published meanwhile."""
        hp, start, tree = self.page_size, job.start, self.tree
        end = start + len(job.keys) * hp
        prefix = tree.match_prefix(job.tokens[:start]).slots
        if prefix.numel() != start:
            raise RuntimeError(f"HiCache: locked prefix shrank to {prefix.numel()} < {start}")
        dup = tree.insert(job.tokens[:end], torch.cat([prefix, job.slots]))
        if dup > start:
            self.kv.allocator.free(job.slots[: dup - start])
        job.hold = tree.match_prefix(job.tokens[:end]).last_node
        tree.inc_lock_ref(job.hold)
        disk = hp * len(job.from_disk.intersection(job.keys))
        self._count(host_hit_tokens=end - start - disk, disk_hit_tokens=disk,
                    bytes_loaded=len(job.keys) * self.page_bytes,
                    load_seconds=time.perf_counter() - job.dispatched)
        self._finish(job)

    def _finish(self, job: LoadJob) -> None:
        if job.base is not None:
            self.tree.dec_lock_ref(job.base)
            job.base = None
        job.state = LOADED
        job.slots = None
        for key in list(self.loading):
            if self.loading[key] is job:
                del self.loading[key]

    def _drop(self, job: LoadJob) -> None:
        self.jobs.remove(job)
        for rid in [r for r, j in self.of.items() if j is job]:
            del self.of[rid]
