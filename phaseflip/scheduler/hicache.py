"""The HiCache controller: the one decider of every KV page transfer between device, host, disk.

Pages are `hicache_page_size` consecutive tokens of a sequence, keyed by a hash chain of their
token ids salted with the model fingerprint, in the canonical layout-free format
(`cache/hicache/page.py`). The controller runs on the driver only; it decides which page is
stored into which host frame and which slots a page is loaded into, and sends those decisions
as `TransferOrders` through a channel: executed at once on the local `KVTransferEngine` (one
process), or riding the next plan broadcast to every rank (TP/PP), each rank copying its slice.
Nothing here waits for a copy except `quiesce` (called only when there is nothing else to do).

Stores. Write-through: prefixes published to the radix tree become store orders in the same
step. Write-back: pages are stored when the device would lose them: a cleaner stores the least
recently used unlocked leaves while free slots run low; a dirty page the cleaner missed is
copied synchronously at eviction (`sync_writebacks` counts that fallback). Either way the
source slots are read by an asynchronous copy, so the tree node holding them stays LOCKED (a
lock reference) until the copy is done on every rank, which the controller polls each step; the
target frames stay reserved in the host pool (invisible, not evictable) until then. A done page
is committed to the host tier and queued for the disk thread (a full queue drops the disk copy).

Loads (read-through as prefetch; `LoadPath` in scheduler/hicache_load.py). When a waiting
request is considered for admission, the pages that follow its device-cached prefix and exist
in a tier start their way: disk pages are promoted into host frames on the disk thread, then
every page is copied host->device into fresh slots. A load's pages stay pinned in the host
tier from the prefetch that chose them (or from landing) until its copy is done, so a burst's
later promotions cannot evict them unread; a request whose first disk page finds every host
frame held waits for the loads in flight.
The request is skipped (others are admitted) until its pages are *visible*; they are then
inserted into the radix tree, so admission matches them like any cached prefix and the request
is priced by its uncached tokens only. Slots of a load in flight are held by its `LoadJob`
(`in_flight_slots`): allocated, neither free nor in the tree nor any request's; they join the
tree when visible. The scheduler quiesces the controller before it reports idle, so the pool
accounting checked at idle (`total = free + evictable + locked`) never sees such slots.

Lifetime. The controller, its host tier (frames and index) and its disk tier outlive every
layout: made before the first runner (whose ranks map the frames), bound to one layout at a
time (`bind`: the tree hooks and the transfer channel), unbound by a phase flip once nothing is
in flight and the device tree is dropped, so the fenced pages serve the re-admitted requests
from host memory; `close` frees the host tier at the engine's end.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from phaseflip.cache.hicache import (
    DiskPageStore,
    HostFrames,
    HostPagePool,
    PageGeometry,
    TransferOrders,
    model_fingerprint,
    page_header,
    page_keys,
)
from phaseflip.cache.hicache.disk_io import DiskIO
from phaseflip.cache.hicache.frames import (
    host_capacity_pages,
    page_geometry,
    shared_frames_path,
)
from phaseflip.cache.hicache.transfer import TransferChannel
from phaseflip.config import EngineConfig
from phaseflip.errors import InvalidRequestError
from phaseflip.model.config import ModelConfig
from phaseflip.scheduler.hicache_load import FRAME_WAITS, LoadPath
from phaseflip.scheduler.hicache_state import HiCacheStats, StoreJob, kv_producer_id
from phaseflip.scheduler.kv_cache import KVCacheManager
from phaseflip.scheduler.request import Req

__all__ = ["FRAME_WAITS", "HiCache"]
log = logging.getLogger("phaseflip.hicache")

class HiCache:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, *,
                 shared: bool) -> None:
        """The layout-free part, made once per engine before its first runner: keys, the host
        tier (frames and index) and the disk tier. `shared`: the frames are node shared memory
        that the ranks of a TP/PP group map by name. `bind` attaches it to a layout."""
        self.model_cfg = model_cfg
        self.page_size = cfg.hicache_page_size
        raw = {k: v for k, v in vars(model_cfg).items() if k not in ("model_dir",
                                                                     "generation_defaults")}
        self.fingerprint = model_fingerprint(
            {k: str(v) for k, v in raw.items()}, dtype,
            weights_id=kv_producer_id(cfg, model_cfg))
        self.geometry = geo = self._geometry(dtype)
        capacity = host_capacity_pages(cfg.hicache_host_gb * 2**30, geo)
        frames = (HostFrames.create_shared(shared_frames_path(), capacity, geo.total_size)
                  if shared else HostFrames.private(capacity, geo.total_size))
        self.host = HostPagePool(frames.capacity, geo.total_size, fingerprint=self.fingerprint,
                                 frames=frames)
        try:
            self.disk = (DiskPageStore(cfg.hicache_dir, self.fingerprint,
                                       int(cfg.hicache_disk_gb * 2**30), geometry=geo)
                         if cfg.hicache_dir else None)
        except OSError as exc:  # it cannot be created or listed
            frames.close()
            raise InvalidRequestError(f"--hicache-dir {cfg.hicache_dir}: cannot use it for the "
                                      f"disk tier ({exc}); give a directory this user can "
                                      "create and write", "hicache_dir") from exc
        self.io = (DiskIO(self.disk, self.host, geo, cfg.hicache_disk_queue_pages)
                   if self.disk is not None else None)
        self._header = torch.frombuffer(bytearray(page_header(geo, self.fingerprint)),
                                        dtype=torch.uint8)
        self._stats = HiCacheStats()
        self._stats_lock = threading.Lock()
        self._published: list[list[int]] = []
        self._stores: list[StoreJob] = []
        self._storing: set[bytes] = set()
        self.loads = LoadPath(self.host, self.io, self.page_size, geo.payload_len, self._keys,
                              self._count, lambda: self.busy)
        self._clean_ids: set[int] = set()  # tree nodes whose pages are all in the host tier
        self.write_back = cfg.hicache_write_policy == "write_back"
        # the layout bound now (`bind`/`unbind`): its KV manager, radix tree, transfer channel
        self.kv: KVCacheManager | None = None
        self.tree: Any = None
        self.channel: TransferChannel | None = None
        self.closed = False

    def _geometry(self, dtype: torch.dtype) -> PageGeometry:
        """The canonical page: model dims, KV dtype and page size, never the layout."""
        m = self.model_cfg
        return page_geometry(m.num_layers, m.num_kv_heads, m.head_dim, dtype, self.page_size)

    # ------------------------------------------------------------------ layouts
    def bind(self, kv: KVCacheManager, channel: TransferChannel, dtype: torch.dtype) -> None:
        """Attach to one layout: the tree hooks of its KV manager and the channel its runner
        opened to its ranks over this host tier (`Runner.transfer_channel`), `dtype` its KV
        dtype. The host tier and its index carry over unchanged from the previous layout."""
        if self.closed or self.kv is not None:
            raise RuntimeError("HiCache: bind needs an open controller bound to no layout")
        self._check_unbound_state("bind")
        if self._geometry(dtype) != self.geometry:
            raise RuntimeError(f"HiCache: the layout's page geometry {self._geometry(dtype)} "
                               f"differs from the host tier's {self.geometry}; its pages cannot "
                               "be read under this layout")
        self.kv, self.tree, self.channel = kv, kv.tree, channel
        self.loads.bind(kv, channel)
        self._clean_ids.clear()  # node ids of an earlier tree
        if self.write_back:
            self.tree.on_evict = self._evicting
            self.clean_below_slots = max(2 * self.page_size, kv.allocator.total_slots // 8)
        else:
            kv.on_publish = self._publish

    def unbind(self) -> None:
        """Detach from the layout (the phase flip, once fence, retract, quiesce and the tree's
        drop have run): the host tier, its index and the disk tier stay for the next `bind`.
        Raises, changing nothing, while anything still refers to the layout."""
        if self.kv is None:
            raise RuntimeError("HiCache: unbind of a controller bound to no layout")
        self._check_unbound_state("unbind")
        if self.tree.total_size():
            raise RuntimeError(f"HiCache: unbind while the device tree holds "
                               f"{self.tree.total_size()} tokens (drop it first)")
        if self.write_back:
            self.tree.on_evict = None
        else:
            self.kv.on_publish = None
        self.channel.close()
        self.kv, self.tree, self.channel = None, None, None
        self.loads.unbind()

    def _check_unbound_state(self, what: str) -> None:
        """Crash before corruption: no job, hold, ticket or slot of a layout may cross to
        another (a fence and a quiesce leave none)."""
        left = {name: len(v) for name, v in (
            ("published", self._published), ("stores", self._stores),
            ("storing", self._storing)) if v} | self.loads.pending()
        if left:
            raise RuntimeError(f"HiCache: {what} with work tied to a layout still in flight "
                               f"{left}; fence and quiesce first")

    # ------------------------------------------------------------------ queries
    @property
    def stats(self) -> HiCacheStats:
        """A snapshot: the controller's counters with the tiers' own."""
        with self._stats_lock:
            s = dataclasses.replace(self._stats)
        s.host_evictions = self.host.stats.evictions
        if self.disk is not None and self.io is not None:
            d = self.disk.stats
            s.bytes_written, s.corrupt_pages, s.disk_evictions = (d.bytes_written, d.corrupt,
                                                                  d.evictions)
            s.disk_writes_dropped = self.io.writes_dropped
            s.disk_write_failures, s.disk_read_errors, s.foreign_pages = (
                d.write_failures, d.read_errors, d.foreign)
        if s.store_seconds > 0:
            s.store_gbps = s.bytes_stored / s.store_seconds / 1e9
        if s.load_seconds > 0:
            s.load_gbps = s.bytes_loaded / s.load_seconds / 1e9
        s.stores_in_flight = sum(len(j.keys) for j in self._stores)
        s.loads_in_flight = self.loads.pages_in_flight
        return s

    @property
    def in_flight_slots(self) -> int:
        """Device slots held by loads not yet in the tree (outside the pool's four classes)."""
        return self.loads.in_flight_slots

    @property
    def busy(self) -> bool:
        """Anything dispatched or queued that is not done (disk writes excepted: they need no
        device slot and no scheduler step)."""
        return bool(self._published or self._stores or self.loads.busy)

    @property
    def decode_reserve(self) -> Callable[[], int] | None:
        """The scheduler's current decode reserve in slots (set by the engine; None: none),
        which a load must leave free when its copy starts."""
        return self.loads.decode_reserve

    @decode_reserve.setter
    def decode_reserve(self, reserve: Callable[[], int] | None) -> None:
        self.loads.decode_reserve = reserve

    @property
    def _promoting(self) -> dict[bytes, Future[bool]]:
        """The promotions (disk reads) in flight, the load path's (tests plant a future
        here to keep the controller busy)."""
        return self.loads.promoting

    def _keys(self, token_ids: list[int]) -> list[bytes]:
        return page_keys(token_ids, self.page_size, self.fingerprint)

    def _count(self, **deltas: float) -> None:
        with self._stats_lock:
            for name, d in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + d)

    # ------------------------------------------------------------------ step hooks
    def begin_step(self) -> None:
        """Retire finished transfers and move every job on (called first in each schedule)."""
        self.poll()
        if self.write_back:
            self._clean()

    def end_step(self) -> None:
        """Loaded pages lose their hold once the step that could admit their request is over
        (then they are ordinary cached prefixes); finished jobs are dropped."""
        self.loads.end_step()

    def poll(self) -> None:
        """Retire what ended: promotions (an I/O thread crash raises: not a miss), stores,
        then every load moves on; then this step's store orders."""
        self.loads.land()
        for job in list(self._stores):
            if self.channel.done(job.ticket):
                self._finish_store(job)
        self.loads.advance_all()
        self.publish_pending()

    def quiesce(self) -> None:
        """Wait until nothing is in flight: promotions, copies on every rank, holds aside.
        Only for when the scheduler has nothing else to run (or a fence)."""
        for _ in range(4):  # each round moves every job at least one state on
            if not self.busy:
                break
            for fut in list(self.loads.promoting.values()):
                fut.exception()  # waits
            self.poll()
            self.channel.fence()
            self.poll()
        if self.busy:
            raise RuntimeError(f"HiCache could not quiesce: {self.stats}")
        # No step follows to end the holds of pages loaded here (say, for a request aborted
        # while its copy ran): they become ordinary cached prefixes now, or they would stay
        # locked through idle and make a cache flush fail.
        self.end_step()

    def fence(self) -> None:
        """Every full page of every cached prefix is in the host tier when this returns, and
        nothing is in flight (the phase flip's fence, design law 6). Under write-back this
        stores the dirty pages now; under write-through only what a full host tier skipped."""
        self.publish_pending()
        for leaf in self.tree.leaves():
            if leaf.node_id in self._clean_ids:
                continue
            tokens, slots = self.tree.path_of(leaf)
            n = len(tokens) - len(tokens) % self.page_size
            self._store(self._keys(tokens[:n]), slots[:n], leaf)
        self.quiesce()

    def flush(self) -> None:
        """Quiesce, then wait for queued disk writes: an idle tier state that survives a restart."""
        self.quiesce()
        if self.io is not None:
            self.io.flush()

    def close(self) -> None:
        """The engine's end: stop the disk thread and the channel, then free the host tier
        (a phase flip unbinds instead, keeping it)."""
        if self.closed:
            return
        self.closed = True
        if self.io is not None:
            self.io.close()
        if self.channel is not None:
            self.channel.close()
        self.host.frames.close()

    # ------------------------------------------------------------------ stores
    def _publish(self, token_ids: list[int], slots: torch.Tensor) -> None:
        """KVCacheManager.on_publish: called BEFORE the tree takes the prefix, so the pages are
        stored (from the tree's own slots, under a lock) by `publish_pending`, right after."""
        if len(token_ids) >= self.page_size:
            self._published.append(token_ids)

    def publish_pending(self) -> None:
        """Store orders for every prefix published since the last call (write-through)."""
        pending, self._published = self._published, []
        for tokens in pending:
            n = len(tokens) - len(tokens) % self.page_size
            keys = self._keys(tokens[:n])
            if all(k in self._storing or self.host.contains(k) for k in keys):
                continue
            match = self.tree.match_prefix(tokens[:n])
            m = int(match.slots.numel()) // self.page_size * self.page_size
            if m == 0:
                continue  # evicted already: nothing to read the pages from
            node = match.last_node
            if m < match.slots.numel():
                node = self.tree.match_prefix(tokens[:m]).last_node
            self._store(keys[: m // self.page_size], match.slots[:m], node)

    def _store(self, keys: list[bytes], slots: torch.Tensor, node: Any) -> StoreJob | None:
        """Dispatch the copies of the pages among `keys` (at `slots`) that no tier holds,
        locking `node` (whose path holds `slots`) until they are done."""
        hp = self.page_size
        todo = [i for i, k in enumerate(keys) if k not in self._storing
                and not self.host.contains(k)]
        frames: list[int] = []
        for _ in todo:
            frame = self.host.reserve()
            if frame is None:
                break  # every frame pinned or in flight: skip, the device still has the KV
            frames.append(frame)
        todo = todo[: len(frames)]
        if not todo:
            return None
        off = self.geometry.payload_offset
        for frame in frames:
            self.host.frame(frame, off).copy_(self._header)  # unsealed header: driver-side
        orders = TransferOrders(store_frames=frames,
                                store_slots=[slots[i * hp : (i + 1) * hp] for i in todo])
        if node is not None:
            self.tree.inc_lock_ref(node)
        job = StoreJob([keys[i] for i in todo], frames, node, self.channel.dispatch(orders))
        self._storing.update(job.keys)
        self._stores.append(job)
        return job

    def _finish_store(self, job: StoreJob) -> None:
        self._stores.remove(job)
        self._storing.difference_update(job.keys)
        if job.node is not None:
            self.tree.dec_lock_ref(job.node)
        stored = 0
        for key, frame in zip(job.keys, job.frames):
            if self.host.commit(key, frame):
                stored += 1
                if self.io is not None and not self.disk.contains(key):
                    self.io.write(key)
        self._count(pages_written=stored,
                    bytes_stored=len(job.keys) * self.geometry.payload_len,
                    store_seconds=time.perf_counter() - job.dispatched)

    def _evicting(self, token_ids: list[int], slots: torch.Tensor) -> None:
        """RadixCache.on_evict (write-back): the node's slots are freed right after this call,
        so a dirty page the cleaner did not reach is copied synchronously here."""
        n = len(token_ids) - len(token_ids) % self.page_size
        keys = self._keys(token_ids[:n])
        job = self._store(keys, slots[:n], None)
        if job is None:
            return
        self.channel.fence()
        self._finish_store(job)
        self._count(sync_writebacks=len(job.keys))

    def _clean(self) -> None:
        """Write-back cleaner: while free slots run low, store the least recently used unlocked
        leaves (locked until their copies are done) so eviction finds them clean."""
        free = self.kv.allocator.free_slots
        if free >= self.clean_below_slots or not self.tree.evictable_size():
            return
        budget = math.ceil((self.clean_below_slots - free) / self.page_size)
        for leaf in sorted(self.tree.leaves(unlocked_only=True), key=lambda n: n.last_access):
            if budget <= 0:
                return
            if leaf.node_id in self._clean_ids:
                continue
            tokens, slots = self.tree.path_of(leaf)
            n = len(tokens) - len(tokens) % self.page_size
            keys = self._keys(tokens[:n])
            job = self._store(keys, slots[:n], leaf)  # whole leaves: eviction takes them whole
            if job is None:
                if all(self.host.contains(k) for k in keys):
                    self._clean_ids.add(leaf.node_id)
                continue
            budget -= len(job.keys)
        if len(self._clean_ids) > 1 << 16:
            self._clean_ids.clear()

    # ------------------------------------------------------------------ loads
    def prefetch(self, req: Req, tokens: list[int], spare_tokens: int) -> bool:
        """True when `req` may be admitted now; False while its pages are on their way
        (`LoadPath.prefetch`)."""
        return self.loads.prefetch(req, tokens, spare_tokens)

    def admitted(self, req: Req) -> None:
        """`req` was admitted: its prefetch's miss is counted, its load's hold goes."""
        self.loads.admitted(req)

    def unhold(self, req: Req) -> None:
        """Drops the hold of `req`'s load, if any: its pages stay in the tree."""
        self.loads.unhold(req)

    def forget(self, req: Req) -> None:
        """`req` left the queue; its load (if any) still completes into the tree."""
        self.loads.forget(req)
