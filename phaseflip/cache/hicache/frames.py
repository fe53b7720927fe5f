"""The memory behind the host tier: `capacity` fixed-stride page frames in one host buffer.

Two kinds. A *private* buffer (one process: the single-rank engine) is allocated pinned when
CUDA is present. A *shared* buffer is a file in /dev/shm created by the driver and mapped by every
local rank by name, so the ranks of a TP/PP group write and read their slices of the same frames
and a page stored under one layout is read under another (the phase flip needs exactly that).
Each process page-locks its own mapping with `cudaHostRegister` when CUDA is present, so its
device<->host copies are real asynchronous DMA.

Only the bytes are shared: which page lives in which frame (the index, LRU and pins) is known
to the driver alone (`HostPagePool`), and frame numbers travel to ranks inside transfer orders.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from pathlib import Path

import torch

from phaseflip.cache.hicache.page import PageGeometry
from phaseflip.node_files import node_file_path, remove_stale

log = logging.getLogger("phaseflip.hicache")

FRAME_ALIGN = 64  # frame stride: keeps every payload aligned for any dtype view


def frame_stride(page_bytes: int) -> int:
    return -(-page_bytes // FRAME_ALIGN) * FRAME_ALIGN


class HostFrames:
    """`capacity` frames of `stride` bytes in one uint8 CPU tensor (`buf`)."""

    def __init__(self, buf: torch.Tensor, stride: int, *, path: Path | None = None,
                 owner: bool = False, keepalive: object = None, registered: bool = False):
        self.buf, self.stride = buf, stride
        self.capacity = len(buf) // stride
        self.path, self._owner, self._keepalive = path, owner, keepalive
        self.registered = registered

    @property
    def pinned(self) -> bool:
        """Page-locked for asynchronous device copies (CUDA only)."""
        return self.registered or (self.path is None and self.buf.is_pinned())

    @classmethod
    def private(cls, capacity: int, page_bytes: int, *, pin_memory: bool = True) -> HostFrames:
        stride = frame_stride(page_bytes)
        pin = pin_memory and torch.cuda.is_available()
        return cls(torch.empty(capacity * stride, dtype=torch.uint8, pin_memory=pin), stride)

    @classmethod
    def create_shared(cls, path: str | os.PathLike[str], capacity: int, page_bytes: int,
                      *, register: bool = True) -> HostFrames:
        """A new shared buffer at `path` (a tmpfs file, e.g. under /dev/shm); the creator
        unlinks it on `close`. Raises OSError (naming the size) when tmpfs is too small."""
        path, stride = Path(path), frame_stride(page_bytes)
        size = capacity * stride
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs fails here, not SIGBUS
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise OSError(exc.errno, f"cannot reserve {size / 2**30:.2f} GiB of shared memory at "
                          f"{path} for the HiCache host tier ({exc.strerror}); lower "
                          "--hicache-host-gb or enlarge /dev/shm") from exc
        return cls._map(fd, path, stride, owner=True, register=register)

    @classmethod
    def open_shared(cls, path: str | os.PathLike[str], page_bytes: int, *,
                    register: bool = True) -> HostFrames:
        """Map the driver's shared buffer (a rank of its group on the same node)."""
        fd = os.open(path, os.O_RDWR)
        return cls._map(fd, Path(path), frame_stride(page_bytes), owner=False, register=register)

    @classmethod
    def _map(cls, fd: int, path: Path, stride: int, *, owner: bool, register: bool
             ) -> HostFrames:
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        registered = register and cuda_host_register(buf)
        return cls(buf, stride, path=path, owner=owner, keepalive=mm, registered=registered)

    def frame(self, index: int, length: int | None = None) -> torch.Tensor:
        """Frame `index` as a uint8 tensor view (`length` bytes, default the whole stride)."""
        if not 0 <= index < self.capacity:
            raise IndexError(f"frame {index} outside [0, {self.capacity})")
        start = index * self.stride
        return self.buf[start : start + (self.stride if length is None else length)]

    def close(self) -> None:
        """Unregister and unmap; the creator also unlinks the file. Views must be dropped."""
        if self.registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.registered = False
        if self._owner and self.path is not None:
            self.path.unlink(missing_ok=True)
            self._owner = False
        self.buf = torch.empty(0, dtype=torch.uint8)
        if isinstance(self._keepalive, mmap.mmap):
            with contextlib.suppress(BufferError):  # a live view elsewhere: unmapped at exit
                self._keepalive.close()
        self._keepalive = None


def cuda_host_register(buf: torch.Tensor, what: str = "the shared host tier") -> bool:
    """Page-lock a mapped buffer for async DMA; False (logged, naming `what`) when CUDA or the
    call fails: copies stay correct, only synchronous."""
    if not torch.cuda.is_available() or len(buf) == 0:
        return False
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), len(buf), 0)
    except Exception as exc:  # noqa: BLE001 — best effort: copies stay correct, only slower
        log.warning("cudaHostRegister of %s failed: %s", what, exc)
        return False
    if int(err) != 0:
        _consume_cuda_error()
        log.warning("cudaHostRegister of %s returned %s; host<->device copies from it will be "
                    "synchronous", what, err)
        return False
    return True


def _consume_cuda_error() -> None:
    """A failed cudaHostRegister leaves CUDA's last-error set, and torch reports it at its next
    kernel-launch check as *that* launch's failure (seen on the H200 sandbox: "invalid
    argument" at an unrelated allocation). Torch binds no cudaGetLastError, so trip the check
    once here, where the error is expected."""
    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 — the stale registration error, now consumed
        pass


def page_geometry(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  page_size: int) -> PageGeometry:
    """The canonical page of a model: every layer and every KV head (not a rank's slice)."""
    return PageGeometry(dtype, page_size, num_layers, num_kv_heads, head_dim)


def shared_frames_path() -> Path:
    """A fresh name for a node's shared host tier, in /dev/shm (tmpfs) where there is one;
    the tiers of engines that are gone (killed: none unlinks its own) are removed first."""
    remove_stale("hicache")
    return node_file_path("hicache")


def host_capacity_pages(host_bytes: float, geometry: PageGeometry) -> int:
    """Frames a host tier of `host_bytes` holds (at least one)."""
    return max(1, int(host_bytes // frame_stride(geometry.total_size)))
