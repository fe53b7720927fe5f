"""Disk tier of the HiCache: one file per encoded page in a directory, LRU under a byte budget.

Layout: `<directory>/<first key byte, hex>/<key hex>.page` (256-way fan-out keeps directories
small). A page file is complete or absent under its final name: it is written to a temp file
in the same directory (`.<name>.<nonce>.tmp`) and `os.replace`d, which is atomic on POSIX, so a
crash leaves at worst a temp file (swept on a later start) and never a half page under a key.

Every read verifies the header, the file length and the checksum of every block it returns; a
corrupt or truncated page is a miss with a warning and its file is deleted, so bad bytes never
become tokens and are not met twice. A well-formed page of another model (fingerprint) is a miss
that is left alone. On construction the directory is scanned (headers only) and valid pages of
this model are reused, oldest-modified first in LRU order; hits refresh the file's mtime so the
order survives a restart.

One process should write a directory; any number may read it. `get` of a key this instance has
not indexed still looks at the file system, so pages written by another process (e.g. the
driver, read by a TP rank) are found; only the writer's capacity accounting is exact. A writer
holds an advisory lock (`.lock`, flock) for its life; a second one on the directory logs a
warning (both stay correct, but each keeps only its own pages under its capacity).

Faults are misses, never exceptions: a page that cannot be read, deleted or written is counted
(`StoreStats`) and logged with its cause at the 1st, 10th, 100th, ... failure of its kind, not
once per page. A page that failed and could not be deleted (a read-only directory) is not
looked up again until a put replaces it. A directory deleted while the store runs is made again
by the next put.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar, overload

import torch

from phaseflip.cache.hicache.page import (
    HEADER_FIXED_SIZE,
    KEY_BYTES,
    Buffer,
    CorruptPageError,
    ForeignPageError,
    PageGeometry,
    PageHeader,
    StoreStats,
    decode_slice,
    header_length,
    page_header,
    parse_header,
    slice_offsets,
    verify_chunks,
    verify_page,
)

log = logging.getLogger("phaseflip.hicache")

_SUFFIX = ".page"
_TMP_SUFFIX = ".tmp"
_LOCK_NAME = ".lock"
# what opening a page that is not there raises (a file where its fan-out directory should be
# gives the second): a plain miss
_ABSENT = (FileNotFoundError, NotADirectoryError)
_T = TypeVar("_T")
Ranges = Sequence[tuple[int, int]]


class _FileReader:
    """Positional reads of an open page file: `(offset, length) -> bytes` (fewer only at EOF),
    and `readinto(offset, buf)` straight into caller memory (e.g. a host frame)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __call__(self, off: int, n: int) -> bytes:
        return os.pread(self.fd, n, off)

    def readinto(self, off: int, buf: memoryview) -> int:
        total = 0
        while total < len(buf):
            got = os.preadv(self.fd, [buf[total:]], off + total)
            if got == 0:
                break
            total += got
        return total


ReadAt = _FileReader


class DiskPageStore:
    """Encoded pages of one model (`fingerprint`) under `directory`, at most `capacity_bytes`.

    Invariant (checked by `check`): `used_bytes` is the sum of the sizes of indexed pages.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fingerprint: bytes,
        capacity_bytes: int,
        *,
        fsync: bool = False,
        purge_foreign: bool = False,
        stale_tmp_s: float = 3600.0,
        geometry: PageGeometry | None = None,
    ) -> None:
        """`fsync=True` makes a put durable across power loss (file and directory fsync) at a
        latency cost; without it a crash can lose recent pages but never corrupt one silently
        (checksums catch torn data). Temp files older than `stale_tmp_s` are crash leftovers
        and are swept at start; younger ones may belong to a live writer. With `geometry` (the
        reader's page shape), a page of another shape under a key is corrupt: the key names a
        page of this shape, so the file was copied or renamed in."""
        if len(fingerprint) != KEY_BYTES:
            raise ValueError(f"fingerprint must be {KEY_BYTES} bytes")
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.geometry = geometry
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size, LRU first
        self._used = 0
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._failures: dict[str, int] = {}  # kind -> count, to log the 1st, 10th, 100th, ...
        self._failures_lock = threading.Lock()  # its own: `_warn` may run under `_lock`
        # keys whose file was rejected but is still there (undeletable, foreign, unreadable):
        # not looked up again until a put replaces the file
        self._bad: set[bytes] = set()
        self._lock_fd = self._claim()
        self._scan(purge_foreign, stale_tmp_s)

    # ------------------------------------------------------------ queries

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / f"{name}{_SUFFIX}"

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    @property
    def stats(self) -> StoreStats:
        with self._lock:
            return dataclasses.replace(self._stats)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def contains(self, key: bytes) -> bool:
        """Indexed, or a valid-looking file (header checked) another process wrote."""
        with self._lock:
            if key in self._bad:
                return False
            if key in self._index:
                if self.path(key).exists():
                    return True
                self._forget(key)  # deleted behind the store's back (unlinks here are locked)
                return False
        return self._read(key, lambda _read_at, _header: (True, 0), count=False) is not None

    @overload
    def get(self, key: bytes, ranges: None = None) -> bytes | None: ...

    @overload
    def get(self, key: bytes, ranges: Ranges) -> list[bytes] | None: ...

    def get(self, key: bytes, ranges: Ranges | None = None) -> bytes | list[bytes] | None:
        """The whole verified page, or with `ranges` (block-aligned payload ranges, e.g. from
        `slice_offsets`) only those bytes, each verified; None on a miss or a bad page."""
        if ranges is None:
            def whole(read_at: ReadAt, header: PageHeader) -> tuple[bytes, int]:
                data = read_at(0, header.total_size)
                verify_page(data, self.fingerprint)
                return data, len(data)

            return self._read(key, whole)

        def ranged(read_at: ReadAt, header: PageHeader) -> tuple[list[bytes], int]:
            chunks = [read_at(off, n) for off, n in ranges]
            verify_chunks(header, ranges, chunks)
            return chunks, sum(len(c) for c in chunks)

        return self._read(key, ranged)

    def read_slice(
        self, key: bytes, *, layers: range | None = None, heads: range | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V `[len(layers), len(heads), P, D]` reading only this slice's byte ranges."""

        def sliced(read_at: ReadAt, header: PageHeader) -> tuple[tuple[torch.Tensor, ...], int]:
            ranges = slice_offsets(header, layers, heads)
            chunks = [read_at(off, n) for off, n in ranges]
            k, v = decode_slice(header, chunks, layers=layers, heads=heads)
            return (k, v), sum(n for _, n in ranges)

        kv = self._read(key, sliced)
        return None if kv is None else (kv[0], kv[1])

    # ------------------------------------------------------------ mutation

    def put(self, key: bytes, page: Buffer) -> bool:
        """Store an encoded (sealed) page of this model atomically. False if it cannot be stored
        (larger than the whole budget, or an OS error such as a full disk, logged); True if
        present."""
        data = memoryview(page).cast("B")
        try:
            header = parse_header(data, self.fingerprint)
        except CorruptPageError as exc:  # a caller bug, not a cache miss: refuse loudly
            raise ValueError(f"refusing to store an invalid page: {exc}") from exc
        if len(data) != header.total_size:
            raise ValueError(f"page is {len(data)} bytes, its header says {header.total_size}")
        off = header.payload_offset
        return self._put_chunks(key, [data[:off], data[off:]])

    def put_payload(self, key: bytes, geometry: PageGeometry, payload: Buffer) -> bool:
        """Seal and store a page given its raw payload (e.g. an unsealed host frame's): the
        checksums are computed here, on the caller's (disk) thread, and the payload is written
        from where it lies, without an assembled copy."""
        body = memoryview(payload).cast("B")
        header = page_header(geometry, self.fingerprint, body)
        return self._put_chunks(key, [memoryview(header), body])

    def read_into(self, key: bytes, out: memoryview) -> int | None:
        """Read the whole page into `out` (e.g. a host frame) and verify it; its length, or None
        on a miss or a bad page (deleted, as for `get`; one larger than `out` is bad). `out` may
        hold garbage after a miss."""

        def into(read_at: ReadAt, header: PageHeader) -> tuple[int, int]:
            n = header.total_size
            if len(out) < n:
                raise CorruptPageError(f"page of {n} bytes does not fit a {len(out)}-byte "
                                       "buffer")
            got = read_at.readinto(0, out[:n])
            if got != n:
                raise CorruptPageError(f"truncated page: {got} of {n} bytes")
            verify_page(out[:n], self.fingerprint)
            return n, n

        return self._read(key, into)

    def _put_chunks(self, key: bytes, chunks: list[memoryview]) -> bool:
        size = sum(len(c) for c in chunks)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if size > self.capacity_bytes:
                self._stats.write_failures += 1
                return False
            self._evict_to(self.capacity_bytes - size)
        if not self._write_atomic(self.path(key), chunks):
            with self._lock:
                self._stats.write_failures += 1
            return False
        with self._lock:
            self._stats.bytes_written += size
            self._bad.discard(key)  # whatever was rejected under this key is replaced
            # a reader may have indexed the file while this put wrote it, and an eviction or a
            # delete unlinked it since: indexing it now would count a page no file holds
            # (unlinks happen under the lock, so its absence here is current)
            if not self.path(key).exists():
                return True  # written, then evicted, as any page may be
            self._add(key, size)
            self._evict_to(self.capacity_bytes, keep=key)  # concurrent puts may overshoot
        return True

    def delete(self, key: bytes) -> bool:
        with self._lock:  # unlink under the lock: see `_read`
            indexed = self._forget(key)
            try:
                self.path(key).unlink()
            except FileNotFoundError:
                return indexed
            return True

    def check(self) -> None:
        """Raise RuntimeError unless the byte accounting is exact."""
        with self._lock:
            total = sum(self._index.values())
            if total != self._used:
                raise RuntimeError(f"disk store accounting broken: {self._used} != {total}")

    # ------------------------------------------------------------ internals

    def _read(
        self,
        key: bytes,
        fn: Callable[[ReadAt, PageHeader], tuple[_T, int]],
        *,
        count: bool = True,
    ) -> _T | None:
        """Open the page, validate header and length, run `fn`; every failure is a miss."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            with self._lock:
                # a put may have brought the page back since the open failed (its write is
                # unlocked, its indexing follows): forgetting it then would leave a file no
                # entry counts. Unlinks happen under the lock, so absence here is current.
                if not path.exists():
                    self._forget(key)
                self._stats.misses += count
                if not isinstance(exc, _ABSENT):
                    self._bad.add(key)
                    self._stats.read_errors += 1
            if not isinstance(exc, _ABSENT):
                self._warn("read", "cannot open page %s (served as a miss; check the "
                           "permissions of the HiCache directory): %s", path, exc)
            return None
        try:
            read_at = _FileReader(fd)
            header, size = _read_header(fd, self.fingerprint)
            if self.geometry is not None and _geometry_of(header) != self.geometry:
                raise CorruptPageError(f"page of geometry {_geometry_of(header)} under a key "
                                       f"of {self.geometry}")
            result, nbytes = fn(read_at, header)
        except (CorruptPageError, OSError) as exc:
            self._reject(key, path, exc, count)
            return None
        finally:
            os.close(fd)
        with self._lock:
            # Unlinks by this instance happen under the lock, so a file still present now is
            # indexed consistently even if it was evicted and re-put while we were reading.
            if key in self._index:
                self._index.move_to_end(key)
            elif path.exists():
                self._add(key, size)
            if count:
                self._stats.hits += 1
                self._stats.bytes_read += nbytes
        if count:
            with contextlib.suppress(OSError):  # LRU order across restarts is best effort
                os.utime(path)
        return result

    def _reject(self, key: bytes, path: Path, exc: Exception, count: bool) -> None:
        """A failed read: foreign pages are left alone, corrupt ones deleted, I/O errors kept;
        what stays is not looked up again (`_bad`) until a put replaces it."""
        with self._lock:
            self._forget(key)
            self._stats.misses += count
            if isinstance(exc, ForeignPageError):
                self._stats.foreign += 1
            elif isinstance(exc, CorruptPageError):
                self._stats.corrupt += 1
            else:
                self._stats.read_errors += 1
            self._bad.add(key)
        if isinstance(exc, ForeignPageError):
            self._warn("foreign", "page %s belongs to another model, ignored: %s", path, exc)
        elif isinstance(exc, CorruptPageError):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as unlink_exc:
                self._warn("corrupt", "corrupt page %s served as a miss, but it cannot be "
                           "deleted (%s): %s", path, unlink_exc, exc)
                return
            self._warn("corrupt", "corrupt page %s deleted (served as a miss): %s", path, exc)
            with self._lock:
                self._bad.discard(key)
        else:
            self._warn("read", "cannot read page %s (served as a miss): %s", path, exc)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        """Log a failure of `kind` at its 1st, 10th, 100th, ... occurrence (debug otherwise):
        a broken disk must not write a line per page per step."""
        with self._failures_lock:
            n = self._failures[kind] = self._failures.get(kind, 0) + 1
        first = n == 1
        if str(n).rstrip("0") != "1":
            log.debug("hicache: " + msg, *args)
            return
        log.warning("hicache: " + msg + (" (the first %s failure of the disk tier; logged "
                    "again at the 10th, 100th, ...)" if first else " (%s %s failures so far)"),
                    *args, *((kind,) if first else (n, kind)))

    def _claim(self) -> int | None:
        """The directory's advisory writer lock (None when it cannot be taken): a second
        engine on the directory is told, once, that its capacity is its own pages' only."""
        path = self.directory / _LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self._warn("write", "cannot write to the HiCache directory %s (%s): the disk "
                       "tier serves the pages it has and stores none", self.directory, exc)
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            log.warning("hicache: the HiCache directory %s is in use by another engine (pid "
                        "%s): pages are shared safely, but each engine holds its own pages to "
                        "--hicache-disk-gb, so the directory can grow past it; give each "
                        "engine its own --hicache-dir to keep the bound", self.directory, owner)
            return None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def close(self) -> None:
        """Release the directory's writer lock (the store stays usable)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    def _write_atomic(self, path: Path, chunks: list[memoryview]) -> bool:
        tmp = path.parent / f".{path.name}.{os.getpid()}-{os.urandom(6).hex()}{_TMP_SUFFIX}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the directory may have been deleted
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for view in chunks:
                    while view:
                        view = view[os.write(fd, view) :]
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)  # the only step that makes the page visible
            if self.fsync:
                dir_fd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if not isinstance(exc, OSError):
                raise
            self._warn("write", "cannot write page %s (it stays in the host tier only; check "
                       "the free space and permissions of the HiCache directory): %s", path, exc)
            return False
        return True

    def _add(self, key: bytes, size: int) -> None:
        """Index a page at the MRU end (locked); idempotent, so adoption races cannot double
        count."""
        if key not in self._index:
            self._index[key] = size
            self._used += size

    def _forget(self, key: bytes) -> bool:
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        return True

    def _evict_to(self, limit: int, keep: bytes | None = None) -> None:
        """Delete least recently used pages until at most `limit` bytes are used (locked)."""
        while self._used > limit:
            victim = next((k for k in self._index if k != keep), None)
            if victim is None:
                return
            self._forget(victim)
            self._stats.evictions += 1
            try:
                self.path(victim).unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:  # e.g. a read-only directory: the file outlives its entry
                self._bad.add(victim)
                self._warn("evict", "cannot delete evicted page %s (the directory holds more "
                           "than --hicache-disk-gb): %s", self.path(victim), exc)

    def _scan(self, purge_foreign: bool, stale_tmp_s: float) -> None:
        """Index this model's valid pages (headers only; payloads are verified when read)."""
        now = time.time()
        found: list[tuple[float, bytes, int]] = []
        for sub in sorted(self.directory.iterdir()):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub):
                path = Path(entry.path)
                if entry.name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(OSError):
                        if now - entry.stat().st_mtime > stale_tmp_s:
                            path.unlink()
                    continue
                key = _key_of(entry.name, sub.name)
                if key is None:
                    continue
                try:
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        _, size = _read_header(fd, self.fingerprint)
                    finally:
                        os.close(fd)
                except ForeignPageError:
                    self._stats.foreign += 1
                    if purge_foreign:
                        with contextlib.suppress(OSError):
                            path.unlink()
                    continue
                except (CorruptPageError, OSError) as exc:
                    self._reject(key, path, exc, count=False)
                    continue
                found.append((entry.stat().st_mtime, key, size))
        with self._lock:
            for _, key, size in sorted(found):
                self._add(key, size)
            self._evict_to(self.capacity_bytes)


def _geometry_of(header: PageHeader) -> PageGeometry:
    return PageGeometry(header.dtype, header.page_size, header.num_layers, header.num_kv_heads,
                        header.head_dim)


def _read_header(fd: int, fingerprint: bytes) -> tuple[PageHeader, int]:
    """The validated header of an open page file and the file's size (which must match)."""
    fixed = os.pread(fd, HEADER_FIXED_SIZE, 0)
    header = parse_header(os.pread(fd, header_length(fixed), 0), fingerprint)
    size = os.fstat(fd).st_size
    if size != header.total_size:
        raise CorruptPageError(f"file is {size} bytes, header says {header.total_size}")
    return header, size


def _key_of(name: str, subdir: str) -> bytes | None:
    """The key a page file name encodes, or None for anything else in the directory."""
    if not name.endswith(_SUFFIX) or not name.startswith(subdir):
        return None
    try:
        key = bytes.fromhex(name[: -len(_SUFFIX)])
    except ValueError:
        return None
    return key if len(key) == KEY_BYTES else None
