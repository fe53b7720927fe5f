"""Host tier of the HiCache: the index (key -> frame, LRU, pins) over fixed-size page frames.

Frames hold pages in the canonical layout (page.py): unsealed pages written by device->host
copies (header fields, raw payload, no checksums) or sealed pages read back from disk, so host
<-> disk moves the frame's bytes as they are and any TP/PP geometry can slice a frame. The frames
(`frames.py`) are allocated once, pinned when CUDA is present (or shared between the local ranks
of a TP/PP group); this index lives only in the driver, which alone decides which frame holds
which page.

A frame is in one of three states: free, *reserved* (an asynchronous copy is filling it: it
belongs to no key, cannot be evicted and becomes visible only at `commit`), or mapped to a key.

Two meanings of "pin" meet here: `pin_memory` is page-locked host memory (a CUDA notion);
`pin(key)` is a reference count that protects a page from eviction while a transfer reads or
writes its frame. Eviction is LRU over pages whose pin count is zero.

Thread safety: every public method takes the pool's lock, so a transfer thread may use the pool
alongside the scheduler thread. A memoryview returned by `get` aliases the frame: it stays valid
only while the page is pinned (use `acquire`), or until the next `put`/`delete` otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.page import (
    Buffer,
    StoreStats,
    encode_page_into,
)

EvictCallback = Callable[[bytes, memoryview], None]


class HostPagePool:
    """`capacity_pages` frames of `page_bytes` (>= one encoded page) each; key -> frame, LRU.

    Invariant (checked by `check`): every frame is exactly one of free, mapped to one key, or
    reserved by an in-flight `put`; pin counts exist only for mapped keys and are > 0.
    """

    def __init__(
        self,
        capacity_pages: int,
        page_bytes: int,
        *,
        pin_memory: bool = True,
        fingerprint: bytes | None = None,
        on_evict: EvictCallback | None = None,
        frames: HostFrames | None = None,
    ) -> None:
        """`fingerprint` is needed only to `put` (k, v) tensors. `on_evict(key, frame)` runs
        under the lock just before a page's frame is reused (e.g. to queue a write-back to
        disk); the view is valid only during the call, so copy what you keep. `frames` is the
        memory (e.g. shared with other ranks); by default a private buffer is allocated."""
        if capacity_pages < 1 or page_bytes < 1:
            raise ValueError(f"need capacity_pages >= 1 and page_bytes >= 1, got "
                             f"{capacity_pages}, {page_bytes}")
        if frames is None:
            frames = HostFrames.private(capacity_pages, page_bytes, pin_memory=pin_memory)
        if frames.capacity < capacity_pages or frames.stride < page_bytes:
            raise ValueError(f"{frames.capacity} frames of {frames.stride} bytes cannot hold "
                             f"{capacity_pages} pages of {page_bytes} bytes")
        self.capacity = capacity_pages
        self.page_bytes = page_bytes
        self.fingerprint = fingerprint
        self.frames = frames
        self._on_evict = on_evict
        self._stride = frames.stride
        self.pinned_memory = frames.pinned
        self._buf = frames.buf
        self._mv = memoryview(self._buf.numpy()).cast("B")
        self._free: list[int] = list(range(capacity_pages - 1, -1, -1))
        self._pages: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (frame, len)
        self._pins: dict[bytes, int] = {}
        self._reserved: set[int] = set()
        self._stats = StoreStats()
        self._lock = threading.RLock()

    # ------------------------------------------------------------ queries

    @property
    def used(self) -> int:
        with self._lock:
            return len(self._pages)

    @property
    def free_frames(self) -> int:
        """Frames neither mapped nor reserved."""
        with self._lock:
            return len(self._free)

    @property
    def pinned_pages(self) -> int:
        """Pages pinned now (a transfer reads or writes their frames)."""
        with self._lock:
            return len(self._pins)

    @property
    def stats(self) -> StoreStats:
        """A snapshot (a copy: the live counters keep moving under the lock)."""
        with self._lock:
            return dataclasses.replace(self._stats)

    def __len__(self) -> int:
        return self.used

    def contains(self, key: bytes) -> bool:
        """Presence only: touches neither LRU order nor hit/miss counters."""
        with self._lock:
            return key in self._pages

    def pin_count(self, key: bytes) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def get(self, key: bytes) -> memoryview | None:
        """The encoded page (a view of its frame) and a touch in LRU order, or None (a miss)."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._pages.move_to_end(key)
            frame, length = entry
            self._stats.hits += 1
            self._stats.bytes_read += length
            return self._mv[frame * self._stride : frame * self._stride + length]

    def acquire(self, key: bytes) -> memoryview | None:
        """`get` and `pin` in one step, so the view cannot be evicted in between; the caller
        must `unpin(key)` when it is done with the view."""
        with self._lock:
            view = self.get(key)
            if view is not None:
                self.pin(key)
            return view

    def frame_tensor(self, key: bytes) -> torch.Tensor | None:
        """The page's frame as a uint8 tensor (pinned memory when available) for an async
        host->device copy; same lifetime rule as `get`. Does not count as a hit."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                return None
            frame, length = entry
            return self._buf[frame * self._stride : frame * self._stride + length]

    def keys(self) -> list[bytes]:
        """The mapped keys, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._pages)

    def frame_of(self, key: bytes) -> int | None:
        """Frame index of a mapped page (no touch, no counters)."""
        with self._lock:
            entry = self._pages.get(key)
            return None if entry is None else entry[0]

    def acquire_frame(self, key: bytes) -> int | None:
        """Pin the page and return its frame index (a hit, touched), or None (a miss). The
        caller hands the index to a transfer and must `unpin(key)` once it completed."""
        with self._lock:
            view = self.get(key)
            if view is None:
                return None
            self.pin(key)
            return self._pages[key][0]

    def pin_frame(self, key: bytes) -> int | None:
        """Pin the page and return its frame index, atomically and without counting a hit
        (a reader that is not a request, e.g. the disk writer); None if absent."""
        with self._lock:
            entry = self._pages.get(key)
            if entry is None:
                return None
            self.pin(key)
            return entry[0]

    def frame(self, index: int, length: int | None = None) -> torch.Tensor:
        """Frame `index` as a uint8 tensor (its first `length` bytes, default the page size)."""
        return self.frames.frame(index, self.page_bytes if length is None else length)

    # ------------------------------------------------------------ asynchronous fills

    def reserve(self) -> int | None:
        """A frame for an asynchronous write (evicting the LRU unpinned page if needed), or
        None when every frame is pinned or reserved. Nobody else can map, evict or write it
        until `commit` or `abandon`."""
        with self._lock:
            frame = self._take_frame()
            if frame is None:
                self._stats.write_failures += 1
                return None
            self._reserved.add(frame)
            return frame

    def commit(self, key: bytes, frame: int, length: int | None = None, *,
               pin: bool = False) -> bool:
        """Map a reserved, now filled frame to `key`. If `key` got mapped meanwhile (same
        content, another writer) the frame is freed instead; returns whether it was mapped.
        `pin`: the page (either frame) is pinned in the same step, so no reservation can evict
        it before the caller, who must `unpin` it, hands it on (a promotion from disk)."""
        length = self.page_bytes if length is None else length
        with self._lock:
            self._unreserve(frame)
            mapped = key not in self._pages
            if mapped:
                self._pages[key] = (frame, length)
                self._stats.bytes_written += length
            else:
                self._free.append(frame)
                self._pages.move_to_end(key)
            if pin:
                self.pin(key)
            return mapped

    def abandon(self, frame: int) -> None:
        """Give back a reserved frame whose fill failed or was cancelled."""
        with self._lock:
            self._unreserve(frame)
            self._free.append(frame)

    def _unreserve(self, frame: int) -> None:
        if frame not in self._reserved:
            raise RuntimeError(f"host frame {frame} is not reserved")
        self._reserved.discard(frame)

    # ------------------------------------------------------------ mutation

    def pin(self, key: bytes) -> None:
        with self._lock:
            if key not in self._pages:
                raise KeyError(f"cannot pin absent page {key.hex()}")
            self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        with self._lock:
            count = self._pins.get(key, 0)
            if count <= 0:
                raise RuntimeError(f"unpin of page {key.hex()} that is not pinned")
            if count == 1:
                del self._pins[key]
            else:
                self._pins[key] = count - 1

    def put(self, key: bytes, page: Buffer | tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Store an encoded page, or (k, v) `[L, H, P, D]` copied straight into the frame as an
        unsealed page (synchronously; the engine's transfers use `reserve`/`commit`).

        Returns False when every frame is pinned or reserved (nothing evictable). A present key
        is only touched: content addressing means its bytes cannot differ.
        """
        with self._lock:
            if key in self._pages:
                self._pages.move_to_end(key)
                return True
            frame = self._take_frame()
            if frame is None:
                self._stats.write_failures += 1
                return False
            self._reserved.add(frame)
        # The frame is reserved: no other thread can map, evict or write it, so the copy (maybe
        # device->host) runs without holding the lock.
        try:
            length = self._write(frame, page)
        except BaseException:
            with self._lock:
                self._reserved.discard(frame)
                self._free.append(frame)
            raise
        with self._lock:
            self._reserved.discard(frame)
            if key in self._pages:  # another thread stored the same content meanwhile
                self._free.append(frame)
                return True
            self._pages[key] = (frame, length)
            self._stats.bytes_written += length
            return True

    def delete(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._pages:
                return False
            if key in self._pins:
                raise RuntimeError(f"delete of page {key.hex()} while pinned (transfer in flight)")
            frame, _ = self._pages.pop(key)
            self._free.append(frame)
            return True

    def check(self) -> None:
        """Raise RuntimeError unless the frame accounting is exact."""
        with self._lock:
            mapped = [frame for frame, _ in self._pages.values()]
            frames = mapped + self._free + sorted(self._reserved)
            if len(frames) != self.capacity or set(frames) != set(range(self.capacity)):
                raise RuntimeError(
                    f"host pool accounting broken: {len(mapped)} mapped + {len(self._free)} free"
                    f" + {len(self._reserved)} reserved != {self.capacity} distinct frames"
                )
            if any(length > self.page_bytes for _, length in self._pages.values()):
                raise RuntimeError("host pool holds a page longer than its frame")
            bad = [k for k, c in self._pins.items() if c <= 0 or k not in self._pages]
            if bad:
                raise RuntimeError(f"host pool pins on absent pages: {[k.hex() for k in bad]}")

    # ------------------------------------------------------------ internals

    def _take_frame(self) -> int | None:
        """A free frame, evicting the least recently used unpinned page if needed (locked)."""
        if self._free:
            return self._free.pop()
        victim = next((k for k in self._pages if k not in self._pins), None)
        if victim is None:
            return None
        frame, length = self._pages[victim]
        if self._on_evict is not None:  # before unmapping: if it raises, nothing has changed
            start = frame * self._stride
            self._on_evict(victim, self._mv[start : start + length])
        del self._pages[victim]
        self._stats.evictions += 1
        return frame

    def _write(self, frame: int, page: Buffer | tuple[torch.Tensor, torch.Tensor]) -> int:
        start = frame * self._stride
        if isinstance(page, tuple):
            if self.fingerprint is None:
                raise ValueError("HostPagePool needs a fingerprint to put (k, v) tensors")
            k, v = page
            return encode_page_into(k, v, self.fingerprint,
                                    self._buf[start : start + self.page_bytes], sealed=False)
        data = memoryview(page).cast("B")
        if len(data) > self.page_bytes:
            raise ValueError(f"page of {len(data)} bytes exceeds the frame ({self.page_bytes})")
        self._mv[start : start + len(data)] = data
        return len(data)
