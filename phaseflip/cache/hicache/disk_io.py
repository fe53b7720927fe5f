"""The disk tier's threads: the scheduler hands storage work off and never waits for it.

Two single-thread executors, so a read (which gates a request's admission) never queues behind
writes. A write seals the page (checksums, on the writer thread) and stores it atomically,
reading straight from the host frame, which stays pinned (the host pool's reference count) until
the file is written. Writes queue up to `queue_pages`; a write that finds the queue full is
dropped and counted: the page stays in the host tier, only its disk copy is skipped. A read
(a *promotion*) fills a reserved host frame from the file, verifies it and maps it in the host
tier, pinned for the controller until the load it serves has taken it; any failure is a miss
(the store already logged and deleted a corrupt page).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from phaseflip.cache.hicache.disk_store import DiskPageStore
from phaseflip.cache.hicache.host_pool import HostPagePool
from phaseflip.cache.hicache.page import PageGeometry


class DiskIO:
    def __init__(self, disk: DiskPageStore, host: HostPagePool, geometry: PageGeometry,
                 queue_pages: int) -> None:
        self.disk, self.host, self.geometry = disk, host, geometry
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="phaseflip-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="phaseflip-disk-write")
        self._queue = threading.BoundedSemaphore(max(1, queue_pages))
        self._lock = threading.Lock()
        self.writes_dropped = 0
        self.writes_done = 0
        self.closed = False

    # ------------------------------------------------------------ writes
    def write(self, key: bytes) -> bool:
        """Queue the host page `key` for the disk; False (dropped, counted) when the queue is
        full or the page left the host tier meanwhile. Never blocks."""
        if self.closed or not self._queue.acquire(blocking=False):
            with self._lock:
                self.writes_dropped += 1
            return False
        frame = self.host.pin_frame(key)
        if frame is None:
            self._queue.release()
            return False
        self._writer.submit(self._write_one, key, frame)
        return True

    def _write_one(self, key: bytes, frame: int) -> None:
        g = self.geometry
        try:
            payload = self.host.frame(frame, g.total_size)[g.payload_offset :]
            if self.disk.put_payload(key, g, memoryview(payload.numpy())):
                with self._lock:
                    self.writes_done += 1
        finally:
            self.host.unpin(key)
            self._queue.release()

    def flush(self) -> None:
        """Block until every queued write is on disk (shutdown, tests, a fence)."""
        self._writer.submit(lambda: None).result()

    # ------------------------------------------------------------ reads
    def promote(self, key: bytes) -> Future[bool] | None:
        """Start reading page `key` from disk into a host frame; the future says whether it
        landed: then the page is in the host tier, pinned once for the caller (who must `unpin`
        it), so a later reservation cannot evict it before it is used. None when no host frame
        is free (all pinned or reserved)."""
        if self.closed:
            return None
        frame = self.host.reserve()
        if frame is None:
            return None
        return self._reader.submit(self._read_one, key, frame)

    def _read_one(self, key: bytes, frame: int) -> bool:
        try:
            out = memoryview(self.host.frame(frame, self.host.frames.stride).numpy())
            n = self.disk.read_into(key, out)
        except BaseException:
            self.host.abandon(frame)
            raise
        if n is None or n != self.geometry.total_size:  # a miss, or a page of another size
            self.host.abandon(frame)
            return False
        self.host.commit(key, frame, n, pin=True)
        return True

    def close(self) -> None:
        """Finish queued writes and reads, then stop the threads."""
        if self.closed:
            return
        self.closed = True
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.disk.close()
