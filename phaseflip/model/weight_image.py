"""The host-image weights strategy of the phase flip (docs/design.md): the checkpoint's tensors,
as stored (names, shapes, dtypes), in ONE shared-memory file of the node, so a flip's new ranks
copy their shards from host memory instead of reading the checkpoint from disk again.

The driver builds the image once per engine (`image_for_engine`, reading the checkpoint once
through `iter_checkpoint_tensors`) and owns it: it outlives every layout, like HiCache's host
frames, and the creator unlinks the file at `close`. Every local rank maps it by name
(`DistSpec.weight_image`), page-locked with cudaHostRegister when CUDA is present so the
host→device copies are DMA. Cost: the whole checkpoint, in its stored dtype, in host RAM
(tmpfs, not swappable once page-locked), one copy per node shared by its ranks.

File layout (offsets in bytes):

    [0, 8)        magic b"PFWIMG01"
    [8, 16)       little-endian u64 L: length of the JSON index
    [16, 16 + L)  index: {"model_dir": ..., "tensors": [[name, dtype, shape, offset, nbytes,
                  crc32 as 8 hex digits], ...]} in checkpoint order
    [data, end)   the tensors' bytes, each at a 64-byte aligned offset (any dtype view is
                  aligned); `data` is the index's end rounded up to 4096

Integrity: zlib.crc32 of every tensor's bytes, taken at build. A rank loading from the image
checks the tensors its shard is cut from before it copies them, the first time its mapping
serves each (`verified(names, once=True)`); that pass is also what reads (touches) the bytes,
timed as `read_s`. Later seams copy the tensors a rank has checked without checking them again:
on the H200 the checks were the host-image seam's floor (15 GiB a tp2 rank, ~1.1 s on 8
threads, against 0.45 s of copies), and a rank keeps its mapping for its life. `verify()`
checks on demand. Cost: one pass over those bytes at
zlib's crc32 speed (about 3 GB/s per core with zlib 1.2.13 on the dev box), spread over a few
threads (zlib releases the GIL). Under TP every rank of a stage checks its stage's tensors
whole, though it copies 1/tp of each.

The read and the copies are pipelined tensor by tensor (`WeightImage.verified`): the checks
of the next tensors run on threads while the current one is copied; `read_s` is what the
copies waited for them, `h2d_wait_s` the copies, `drain_s` the final synchronize.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import struct
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from phaseflip.cache.hicache.frames import cuda_host_register
from phaseflip.errors import PhaseflipError
from phaseflip.model.loader import checkpoint_tensor_specs, iter_checkpoint_tensors
from phaseflip.node_files import node_file_path, remove_stale

if TYPE_CHECKING:
    from phaseflip.config import EngineConfig

log = logging.getLogger(__name__)

MAGIC = b"PFWIMG01"
TENSOR_ALIGN = 64
DATA_ALIGN = 4096
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


class WeightImageError(PhaseflipError):
    """The host weight image cannot be built (no room in /dev/shm) or failed its checksum."""


@dataclass(frozen=True)
class ImageEntry:
    name: str
    dtype: str  # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int
    crc32: int


@dataclass(frozen=True)
class WeightsLoad:
    """How one rank's weights were loaded. `source`: "checkpoint" (read from disk), "dummy"
    (made on the device) or "host-image". The split is measured only for the host image, the
    device parts only on CUDA (law 5: None is unmeasured, not 0)."""

    source: str
    load_s: float  # the whole load, read and copies included
    # host image: the read (checksum) of tensor k+1 runs while tensor k is copied; `read_s` is
    # how long the copies waited for the read (storage-bound when it dominates), `h2d_wait_s`
    # the rest of the loop (the weight loaders' copies into the device parameters: link-bound)
    read_s: float | None = None
    h2d_wait_s: float | None = None
    drain_s: float | None = None  # the final device synchronize
    bytes_read: int | None = None  # image bytes checked and read by this rank
    # parameter bytes written into this rank's shard from outside the device (checkpoint or
    # image); 0 when nothing moved (dummy weights made on the device, resident weights)
    bytes_moved: int | None = None

    def line(self) -> str:
        def s(v: float | None) -> str:
            return "unmeasured" if v is None else f"{v:.3f} s"

        if self.source == "resident":
            return "weights resident on the device (parked at launch): nothing moved"
        if self.source == "peer":
            return (f"weights from the old layout and its peers in {self.load_s:.3f} s "
                    f"({(self.bytes_moved or 0) / 2**30:.3f} GiB received)")
        if self.source != "host-image":
            return f"weights from the {self.source} in {self.load_s:.3f} s"
        return (f"weights from the host image in {self.load_s:.3f} s: read {s(self.read_s)} "
                f"({(self.bytes_read or 0) / 2**30:.2f} GiB), h2d {s(self.h2d_wait_s)}, "
                f"drain {s(self.drain_s)}")


class WeightImage:
    """A checkpoint's tensors in one shared-memory file; see the module docstring."""

    def __init__(self, mm: mmap.mmap, path: Path, entries: list[ImageEntry], *, owner: bool,
                 register: bool) -> None:
        self.path, self.entries = path, {e.name: e for e in entries}
        self._mm, self._owner = mm, owner
        self.buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.checked: set[str] = set()  # tensors this mapping has checked (`verified(once=)`)
        self.registered = register and cuda_host_register(self.buf, "the host weight image")

    @property
    def nbytes(self) -> int:
        return len(self.buf)

    @classmethod
    def build(cls, model_dir: str | os.PathLike[str], path: str | os.PathLike[str] | None = None,
              *, register: bool = True) -> WeightImage:
        """Reads the checkpoint once into a new image at `path` (default: a fresh name in
        /dev/shm). Raises WeightImageError, naming the size, when tmpfs has no room."""
        path = Path(path) if path is not None else image_path()
        remove_stale_images(path.parent)
        specs = checkpoint_tensor_specs(model_dir)
        entries, cursor = [], 0
        for name, dtype, shape, nbytes in specs:
            entries.append(ImageEntry(name, dtype, tuple(shape), cursor, nbytes, 0))
            cursor += -(-nbytes // TENSOR_ALIGN) * TENSOR_ALIGN
        data = DATA_ALIGN  # where the tensors start: past the index (its crc32s are fixed
        while True:  # width, but its offsets grow with `data`)
            placed = [ImageEntry(e.name, e.dtype, e.shape, e.offset + data, e.nbytes, 0)
                      for e in entries]
            need = 16 + len(_index_bytes(model_dir, placed))
            if need <= data:
                break
            data = -(-need // DATA_ALIGN) * DATA_ALIGN
        entries = placed
        size = data + cursor
        _check_headroom(path.parent, size)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # a full tmpfs fails here, not with SIGBUS
            except OSError as exc:
                raise WeightImageError(
                    f"cannot reserve {size / 2**30:.2f} GiB of shared memory at {path} for the "
                    f"host weight image ({exc.strerror}); enlarge /dev/shm (docker: "
                    "--shm-size) or use --flip-weights reload") from exc
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            t0 = time.perf_counter()
            entries = _fill(mm, model_dir, entries)
            index = _index_bytes(model_dir, entries)
            mm[0:16 + len(index)] = MAGIC + struct.pack("<Q", len(index)) + index
            image = cls(mm, path, entries, owner=True, register=register)
        except BaseException:
            mm.close()
            path.unlink(missing_ok=True)
            raise
        log.info("host weight image: %d tensors, %.2f GiB at %s, built in %.2f s%s",
                 len(entries), size / 2**30, path, time.perf_counter() - t0,
                 " (page-locked)" if image.registered else "")
        return image

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, register: bool = True) -> WeightImage:
        """Maps the driver's image (a rank of its group on the same node)."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)  # writable: cudaHostRegister pins it with flags 0
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if mm[0:8] != MAGIC:
            mm.close()
            raise WeightImageError(f"{path} is not a phaseflip weight image")
        (length,) = struct.unpack("<Q", mm[8:16])
        index = json.loads(mm[16:16 + length])
        entries = [ImageEntry(n, d, tuple(s), o, b, int(c, 16))
                   for n, d, s, o, b, c in index["tensors"]]
        return cls(mm, path, entries, owner=False, register=register)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor `name` as a CPU view of the image (no copy; do not write to it)."""
        e = self.entries[name]
        raw = self.buf[e.offset:e.offset + e.nbytes]
        return raw.view(_torch_dtype(e.dtype)).view(e.shape)

    def tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, CPU view) of every tensor (or of `names`), in checkpoint order."""
        keep = None if names is None else set(names)
        for name in self.entries:
            if keep is None or name in keep:
                yield name, self.tensor(name)

    def verify(self, names: Iterable[str] | None = None, threads: int | None = None) -> int:
        """Checks the crc32 of every tensor (or of `names`); returns the bytes checked. Raises
        WeightImageError naming the first tensor whose bytes changed since the build."""
        todo = [self.entries[n] for n in (self.entries if names is None else names)]
        threads = threads or min(8, os.cpu_count() or 1)
        view = memoryview(self._mm)
        try:
            def crc(e: ImageEntry) -> int:
                return zlib.crc32(view[e.offset:e.offset + e.nbytes])

            with ThreadPoolExecutor(threads) as pool:
                got = list(pool.map(crc, todo))
        finally:
            view.release()
        for e, c in zip(todo, got):
            self.check(e, c)
        return sum(e.nbytes for e in todo)

    def verified(self, names: Iterable[str], threads: int | None = None, *,
                 once: bool = False) -> VerifiedStream:
        """(name, CPU view) of `names` in checkpoint order, each yielded once its crc32 is
        checked; the checks of the tensors after it run ahead on `threads` threads (zlib
        releases the GIL), so the reading of tensor k+1 overlaps the copy of tensor k. `once`:
        tensors this mapping checked before come out unchecked (a flip's later seams)."""
        keep = set(names)
        return VerifiedStream(self, [n for n in self.entries if n in keep],
                              threads or min(8, os.cpu_count() or 1),
                              skip=self.checked if once else frozenset())

    def check(self, entry: ImageEntry, crc: int) -> None:
        if crc != entry.crc32:
            raise WeightImageError(
                f"host weight image {self.path}: tensor {entry.name!r} fails its checksum "
                f"(crc32 {crc:08x}, built as {entry.crc32:08x}): the shared memory was "
                "overwritten; restart the engine (or use --flip-weights reload)")

    def close(self) -> None:
        """Unregisters and unmaps; the creator also unlinks the file. Views must be dropped."""
        if self.registered:
            with contextlib.suppress(Exception):
                torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.registered = False
        if self._owner:
            self.path.unlink(missing_ok=True)
            self._owner = False
        self.buf = torch.empty(0, dtype=torch.uint8)
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a live view elsewhere: unmapped at exit
                self._mm.close()
            self._mm = None


class VerifiedStream:
    """The tensors of `WeightImage.verified`, iterated once. `wait_s`: how long the consumer
    waited for a check (the read: storage-bound when it dominates), `nbytes`: bytes checked."""

    def __init__(self, image: WeightImage, names: list[str], threads: int,
                 skip: frozenset[str] | set[str] = frozenset()) -> None:
        self.image, self.names, self.threads = image, names, threads
        self.skip = set(skip)  # checked before by this mapping: yielded without a check
        self.wait_s, self.nbytes = 0.0, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        image = self.image
        view = memoryview(image._mm)
        try:
            with ThreadPoolExecutor(self.threads) as pool:
                futures = [(n, None if n in self.skip else
                            pool.submit(_crc, view, image.entries[n])) for n in self.names]
                try:
                    for name, future in futures:
                        if future is not None:
                            t0 = time.perf_counter()
                            crc = future.result()
                            self.wait_s += time.perf_counter() - t0
                            entry = image.entries[name]
                            image.check(entry, crc)
                            image.checked.add(name)
                            self.nbytes += entry.nbytes
                        yield name, image.tensor(name)
                finally:
                    for _, future in futures:
                        if future is not None:
                            future.cancel()
        finally:
            view.release()


def _crc(view: memoryview, e: ImageEntry) -> int:
    return zlib.crc32(view[e.offset:e.offset + e.nbytes])


def _torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise WeightImageError(f"checkpoint dtype {name} is not supported by the weight image")
    return dtype


def _index_bytes(model_dir, entries: list[ImageEntry]) -> bytes:
    rows = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes, f"{e.crc32:08x}"]
            for e in entries]
    return json.dumps({"model_dir": str(model_dir), "tensors": rows}).encode()


def _fill(mm: mmap.mmap, model_dir, entries: list[ImageEntry]) -> list[ImageEntry]:
    """Copies every checkpoint tensor into its place; returns the entries with their crc32."""
    by_name = {e.name: e for e in entries}
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    view = memoryview(mm)
    crcs: dict[str, int] = {}
    try:
        for name, t in iter_checkpoint_tensors(model_dir, desc="Building the host weight image"):
            e = by_name[name]
            if t.dtype != _torch_dtype(e.dtype) or tuple(t.shape) != e.shape:
                raise WeightImageError(f"tensor {name!r}: header says {e.dtype} {e.shape}, "
                                       f"read {t.dtype} {tuple(t.shape)}")
            if e.nbytes:
                buf[e.offset:e.offset + e.nbytes].copy_(t.contiguous().reshape(-1)
                                                        .view(torch.uint8))
            crcs[name] = zlib.crc32(view[e.offset:e.offset + e.nbytes])
    finally:
        view.release()
        del buf
    return [ImageEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, crcs[e.name])
            for e in entries]


SHM_HEADROOM = 1 << 30  # left free beside the image: NCCL's shared-memory transport needs room


def _check_headroom(directory: Path, size: int) -> None:
    """Refuses an image that would leave its filesystem with less than SHM_HEADROOM free
    (NCCL sets up its shared memory there at every group start, a flip's included)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if size + SHM_HEADROOM > free:
        raise WeightImageError(
            f"the host weight image needs {size / 2**30:.2f} GiB plus "
            f"{SHM_HEADROOM / 2**30:.0f} GiB of headroom in {directory}, which has "
            f"{free / 2**30:.2f} GiB free; enlarge /dev/shm (docker: --shm-size) or use "
            "--flip-weights reload")


def remove_stale_images(directory: Path) -> list[Path]:
    """Unlinks the images of engines that are gone (their pid no longer runs)."""
    return remove_stale("weights", directory)


def image_path() -> Path:
    """A fresh name for a node's weight image: in /dev/shm (tmpfs) where there is one."""
    return node_file_path("weights")


def flip_weights_strategy(cfg: EngineConfig) -> str:
    """"host-image" when a flip's ranks load from the image, else "reload": flips off, one
    rank (no flip keeps a world of 1), dummy weights (no checkpoint; made on the device) or
    --flip-weights reload; "resident" when the ranks keep every layout's shards (no image:
    nothing is loaded at a seam). `auto` is resolved by the engine's planner
    (`flip/weights.py`) before the image is built."""
    if (not cfg.enable_flip or cfg.world_size < 2 or cfg.load_format == "dummy"
            or cfg.flip_weights == "reload"):
        return "reload"
    return cfg.flip_weights if cfg.flip_weights in ("resident", "peer") else "host-image"


def image_for_engine(cfg: EngineConfig, fallback: bool = False) -> WeightImage | None:
    """The engine's image (None: strategy reload). "auto" falls back to reload, warning, when
    the image cannot be built; "host-image" raises WeightImageError naming the fix, unless
    `fallback` (the engine's planner chose it for "auto": its config says host-image)."""
    if flip_weights_strategy(cfg) != "host-image":
        return None
    try:
        # page-locked only for GPU ranks (on a CPU run it would only make a CUDA context)
        return WeightImage.build(cfg.model, register=cfg.device != "cpu")
    except (OSError, WeightImageError) as exc:
        if cfg.flip_weights == "host-image" and not fallback:
            if isinstance(exc, WeightImageError):
                raise
            raise WeightImageError(f"cannot build the host weight image ({exc}); enlarge "
                                   "/dev/shm or use --flip-weights reload") from exc
        log.warning("flip weights: the host image cannot be built (%s); falling back to "
                    "reload (a flip's ranks read the checkpoint again)", exc)
        return None


def load_model_weights(model, cfg: EngineConfig, model_dir: str, device: torch.device,
                       image: WeightImage | None = None) -> WeightsLoad:
    """Loads `model`'s weights from its source: dummy init, the host image, or the checkpoint.
    From the image: the tensors this model's shard is cut from are checksummed (the read),
    then fed to the parameters' weight loaders (the copies), then the device is synchronized."""
    t0 = time.perf_counter()
    if cfg.load_format == "dummy":
        from phaseflip.model.dummy import init_dummy_weights

        init_dummy_weights(model, cfg.seed)
        return WeightsLoad("dummy", time.perf_counter() - t0, bytes_moved=0)
    if image is None:
        model.load_weights(iter_checkpoint_tensors(model_dir))
        return WeightsLoad("checkpoint", time.perf_counter() - t0,
                           bytes_moved=param_bytes(model))
    params = dict(model.named_parameters(remove_duplicate=False))
    wanted = [n for n in image.entries
              if (target := model._param_name(n)) is not None and target[0] in params]
    stream = image.verified(wanted, once=True)  # checks run ahead of the copies
    model.load_weights(stream)  # raises naming any parameter left unloaded
    t2 = time.perf_counter()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    return WeightsLoad("host-image", t3 - t0, read_s=stream.wait_s,
                       h2d_wait_s=t2 - t0 - stream.wait_s if cuda else None,
                       drain_s=t3 - t2 if cuda else None, bytes_read=stream.nbytes,
                       bytes_moved=param_bytes(model))


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters (`parameters()` yields a tied weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
