"""Moving pages between a rank's device KV pool and the host frames, off the forward's path.

The driver decides every transfer (which page goes to which frame, which slots a page is loaded
into) and sends the decisions as `TransferOrders`; each rank's `KVTransferEngine` executes its
own slice of every order: a TP rank its KV heads, a PP stage its layers, i.e. exactly its byte
ranges of the canonical page (page.py's byte-range map). Frame numbers index the host tier the
driver owns, slots the slot space it owns: counts and indices travel, never pointers.

Copies run on a dedicated CUDA stream (on CPU: one worker thread, the same contract), so issuing
them never waits. A rank's forward must see its earlier loads and must not overwrite slots an
earlier store still reads; `order_before_forward` provides the first (the compute stream waits
on every copy issued by an earlier message; GPU-side, the host does not block) and the driver's
slot locks the second (a stored page's slots stay locked until its copy is known complete).

Whole-page operations, no Python loop over blocks: a page set is gathered with one indexed
select from the pool's stacked `[layers, k|v, slots, heads, dim]` buffer and written with one
copy per page (per page and layer for a TP head slice, whose bytes are not contiguous in the
canonical layout); loads mirror that.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.page import PageGeometry, checked_range, payload_tensor
from phaseflip.cache.kv_pool import FP8_DTYPES, KVPool
from phaseflip.layout import Layout


@dataclass
class TransferOrders:
    """The copies one message carries to every rank. Page i of the stores is gathered from
    slots `store_slots[i]` (int64 [page_size]) into host frame `store_frames[i]`; loads go the
    other way. Picklable: they travel inside the per-step plan broadcast."""

    store_frames: list[int] = field(default_factory=list)
    store_slots: list[torch.Tensor] = field(default_factory=list)
    load_frames: list[int] = field(default_factory=list)
    load_slots: list[torch.Tensor] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.store_frames or self.load_frames)

    def extend(self, other: TransferOrders) -> None:
        self.store_frames += other.store_frames
        self.store_slots += other.store_slots
        self.load_frames += other.load_frames
        self.load_slots += other.load_slots


@dataclass(frozen=True)
class RankSlice:
    """The part of every page one rank holds: global layer ids and global KV heads. `writer` is
    False for a TP rank holding a replicated KV head (MQA/GQA with tp > kv heads) that a lower
    rank already writes: the bytes would be identical."""

    layers: range
    heads: range
    writer: bool = True


def rank_slice(layout: Layout, num_layers: int, num_kv_heads: int) -> RankSlice:
    """This rank's slice, with the same head assignment as `QKVParallelLinear`."""
    layers = range(*layout.layer_range(num_layers))
    tp = layout.tp_size
    if num_kv_heads >= tp:
        return RankSlice(layers, range(*layout.shard(num_kv_heads, "key/value heads")))
    head = layout.tp_rank * num_kv_heads // tp
    return RankSlice(layers, range(head, head + 1), layout.tp_rank % (tp // num_kv_heads) == 0)


# ---------------------------------------------------------------- pool access


class PoolPages:
    """Gather/scatter of page sets over one rank's KVPool: `[l, 2, h, n*P, D]` tensors (layer,
    k|v, head, token, dim) whose token axis lists the given slots in order."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        stacked = getattr(pool, "kv", None)
        # an FP8 pool is indexed as its bytes (torch has no FP8 index_copy on CPU)
        self.fp8 = None
        if isinstance(stacked, torch.Tensor) and stacked.dtype in FP8_DTYPES:
            self.fp8, stacked = stacked.dtype, stacked.view(torch.uint8)
        # one indexed op per direction over the stacked buffer; per layer otherwise
        self.kv_t = stacked.transpose(2, 3) if isinstance(stacked, torch.Tensor) else None

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        if self.kv_t is not None:
            out = torch.index_select(self.kv_t, 3, slots)
            return out if self.fp8 is None else out.view(self.fp8)
        return torch.stack([
            torch.stack((k.index_select(0, slots).transpose(0, 1),
                         v.index_select(0, slots).transpose(0, 1)))
            for k, v in zip(self.pool.k, self.pool.v)
        ])

    def scatter(self, slots: torch.Tensor, src: torch.Tensor) -> None:
        if self.fp8 is not None:
            self.kv_t.index_copy_(3, slots, src.to(self.fp8).view(torch.uint8))
            return
        if self.kv_t is not None:
            self.kv_t.index_copy_(3, slots, src.to(self.kv_t.dtype))
            return
        for i, (k, v) in enumerate(zip(self.pool.k, self.pool.v)):
            k.index_copy_(0, slots, src[i, 0].transpose(0, 1).to(k.dtype))
            v.index_copy_(0, slots, src[i, 1].transpose(0, 1).to(v.dtype))


def gather_page(
    k_layers: list[torch.Tensor], v_layers: list[torch.Tensor], slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[L, H, P, D]` of the tokens at `slots` from per-layer `[slots, H, D]` buffers (a
    convenience for tests and tools; the engine moves whole pages with `KVTransferEngine`)."""
    k = torch.stack([layer[slots] for layer in k_layers]).transpose(1, 2)
    v = torch.stack([layer[slots] for layer in v_layers]).transpose(1, 2)
    return k, v


def scatter_page(
    k: torch.Tensor, v: torch.Tensor, k_layers: list[torch.Tensor], v_layers: list[torch.Tensor],
    slots: torch.Tensor, *, layers: range | None = None, heads: range | None = None,
) -> None:
    """Write K, V `[L, H, P, D]` into pool rows `slots` of a (possibly sliced) KVPool.

    `layers`/`heads` pick which of k's layers/heads this pool holds (e.g. a full decoded page
    into a TP rank's pool: heads=its shard); by default k must match the pool exactly.
    """
    layers = checked_range(layers, k.shape[0], "layers")
    heads = checked_range(heads, k.shape[1], "heads")
    if len(layers) != len(k_layers) or len(k_layers) != len(v_layers):
        raise ValueError(f"{len(layers)} page layers for a pool of {len(k_layers)} layers")
    for i, la in enumerate(layers):
        dst_k, dst_v = k_layers[i], v_layers[i]
        if dst_k.shape[1:] != (len(heads), k.shape[3]) or dst_v.shape != dst_k.shape:
            raise ValueError(f"pool layer {tuple(dst_k.shape)} does not fit heads {heads}")
        dst_k[slots] = k[la, heads.start : heads.stop].transpose(0, 1).to(dst_k)
        dst_v[slots] = v[la, heads.start : heads.stop].transpose(0, 1).to(dst_v)


# ---------------------------------------------------------------- copy queues


class CopyHandle:
    """Completion of one submitted batch of copies."""

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> None:
        """Block the host until the copies finished (re-raises a copy's error)."""
        raise NotImplementedError

    def order_before_compute(self) -> None:
        """Make later work on the current (compute) stream start after these copies."""
        self.wait()


class _EventHandle(CopyHandle):
    def __init__(self, event: torch.cuda.Event, device: torch.device, keep: object) -> None:
        self.event, self.device = event, device
        self._keep = keep  # tensors the copies use, kept alive until they are done

    def done(self) -> bool:
        if self._keep is not None and self.event.query():
            self._keep = None
        return self._keep is None

    def wait(self) -> None:
        self.event.synchronize()
        self._keep = None

    def order_before_compute(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class _FutureHandle(CopyHandle):
    def __init__(self, future: Future) -> None:
        self.future = future

    def done(self) -> bool:
        if self.future.done():
            self.future.result()  # a failed copy is an error, never a silent miss
            return True
        return False

    def wait(self) -> None:
        self.future.result()


class _CudaQueue:
    """Copies on a dedicated stream that first waits for the compute stream's queued work (the
    KV a store reads was written by forwards already queued there)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def submit(self, work: Callable[[], object]) -> CopyHandle:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            keep = work()
            event = torch.cuda.Event()
            event.record(self.stream)
        return _EventHandle(event, self.device, keep)


class _ThreadQueue:
    """The CPU stand-in for a copy stream: one worker thread runs copies in submission order.
    It touches only the slots its orders name, which the driver keeps away from forwards."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="phaseflip-kv-copy")

    def submit(self, work: Callable[[], object]) -> CopyHandle:
        def run() -> None:
            with torch.inference_mode():
                work()

        return _FutureHandle(self._pool.submit(run))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ---------------------------------------------------------------- the rank's executor


class KVTransferEngine:
    """Executes transfer orders for one rank: its pool slice <-> its byte ranges of the frames."""

    def __init__(self, pool: KVPool, frames: HostFrames, geometry: PageGeometry,
                 part: RankSlice, device: torch.device) -> None:
        if len(part.layers) != pool.end_layer - pool.start_layer:
            raise ValueError(f"rank slice {part} does not match the pool's layers "
                             f"[{pool.start_layer}, {pool.end_layer})")
        if pool.dtype != geometry.dtype:  # an FP8 page read as bf16 (or back) is garbage
            raise ValueError(f"the KV pool holds {pool.dtype}, the host tier's pages "
                             f"{geometry.dtype}: a page is never read as another dtype")
        self.pool, self.frames, self.geometry, self.part = pool, frames, geometry, part
        self.device = torch.device(device)
        self.pages = PoolPages(pool)
        self.queue = _CudaQueue(self.device) if self.device.type == "cuda" else _ThreadQueue()
        self._outstanding: list[CopyHandle] = []
        self._lock = threading.Lock()
        # a test seam, called before each batch's copies are issued: on the copy thread on CPU
        # (so a slow seam makes the copy pending), on the issuing thread on CUDA
        self.before_copy: Callable[[TransferOrders], None] | None = None

    def execute(self, orders: TransferOrders) -> CopyHandle | None:
        """Issue `orders` without waiting; the handle says when this rank's copies finished."""
        if not orders:
            return None

        def work() -> object:
            if self.before_copy is not None:
                self.before_copy(orders)
            return self._copy(orders)

        handle = self.queue.submit(work)
        with self._lock:
            self._outstanding = [h for h in self._outstanding if not h.done()]
            self._outstanding.append(handle)
        return handle

    def order_before_forward(self) -> None:
        """Every copy issued so far happens before the next forward on this rank (a GPU-side
        wait on CUDA; on CPU the host waits, normally for nothing: a step has passed)."""
        with self._lock:
            handles, self._outstanding = self._outstanding, []
        for h in handles:
            h.order_before_compute()

    def synchronize(self) -> None:
        """Block until every copy issued so far finished (a fence)."""
        with self._lock:
            handles, self._outstanding = self._outstanding, []
        for h in handles:
            h.wait()

    def close(self) -> None:
        self.synchronize()
        close = getattr(self.queue, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------ the copies
    def _copy(self, orders: TransferOrders) -> list[torch.Tensor]:
        """Runs on the copy stream / thread; returns the temporaries the copies still read."""
        keep: list[torch.Tensor] = []
        if orders.store_frames and self.part.writer:
            keep += self._store(orders.store_frames, orders.store_slots)
        if orders.load_frames:
            keep += self._load(orders.load_frames, orders.load_slots)
        return keep

    def _slots(self, slots: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat(slots)
        return flat.to(self.device, non_blocking=True) if self.device.type != "cpu" else flat

    def _regions(self, frame: int) -> torch.Tensor:
        """This rank's `[l, 2, h, P, D]` region of frame `frame` (a strided view for TP)."""
        view = payload_tensor(self.frames.frame(frame), self.geometry)
        layers, heads = self.part.layers, self.part.heads
        return view[layers.start : layers.stop, :, heads.start : heads.stop]

    def _store(self, frames: list[int], slots: list[torch.Tensor]) -> list[torch.Tensor]:
        n, size = len(frames), self.geometry.page_size
        idx = self._slots(slots)
        gathered = self.pages.gather(idx)  # [l, 2, h, n*P, D]
        per_page = gathered.unflatten(3, (n, size)).permute(3, 0, 1, 2, 4, 5).contiguous()
        for i, frame in enumerate(frames):
            _copy_region(self._regions(frame), per_page[i])
        return [idx, per_page]

    def _load(self, frames: list[int], slots: list[torch.Tensor]) -> list[torch.Tensor]:
        idx = self._slots(slots)
        if self.device.type == "cpu":  # no staging: scatter straight from the frames
            src = torch.cat([self._regions(f) for f in frames], dim=3)
            self.pages.scatter(idx, src)
            return []
        part, g = self.part, self.geometry
        staging = torch.empty((len(frames), len(part.layers), 2, len(part.heads), g.page_size,
                               g.head_dim), dtype=g.dtype, device=self.device)
        for i, frame in enumerate(frames):
            _copy_region(staging[i], self._regions(frame))
        self.pages.scatter(idx, staging.permute(1, 2, 3, 0, 4, 5).flatten(3, 4))
        return [idx, staging]


def _copy_region(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src for `[l, 2, h, P, D]` tensors on two devices, one of them maybe a strided
    frame region. A non-contiguous cross-device copy would go through a synchronous pageable
    temporary, so it is split into its contiguous (layer, k|v) runs instead."""
    if dst.device == src.device or (dst.is_contiguous() and src.is_contiguous()):
        dst.copy_(src, non_blocking=True)
        return
    for la in range(dst.shape[0]):
        for kv in (0, 1):
            dst[la, kv].copy_(src[la, kv], non_blocking=True)


# ---------------------------------------------------------------- channels


class TransferChannel:
    """How the driver's orders reach the ranks that execute them, and how it learns they are
    done. A ticket names one dispatch. `visible(t)`: a forward planned from now on reads the
    loaded slots (they may be handed to requests). `done(t)`: every rank's copies finished
    (host frames may be reused, locked source slots released). `fence()`: deliver everything
    dispatched and wait until all of it is done."""

    def dispatch(self, orders: TransferOrders) -> object:
        raise NotImplementedError

    def visible(self, ticket: object) -> bool:
        raise NotImplementedError

    def done(self, ticket: object) -> bool:
        raise NotImplementedError

    def fence(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalChannel(TransferChannel):
    """One process: orders execute at once on the local engine. Its forwards are not ordered
    after the copies, so a load is visible only once it is done (polled, never waited for)."""

    def __init__(self, engine: KVTransferEngine) -> None:
        self.engine = engine

    def dispatch(self, orders: TransferOrders) -> object:
        return self.engine.execute(orders)

    def visible(self, ticket: object) -> bool:
        return self.done(ticket)

    def done(self, ticket: object) -> bool:
        return ticket is None or ticket.done()  # type: ignore[attr-defined]

    def fence(self) -> None:
        self.engine.synchronize()

    def close(self) -> None:
        self.engine.close()
