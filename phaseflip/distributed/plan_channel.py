"""How rank 0's messages (plans, HiCache orders, relayouts) reach the other ranks.

The plan used to travel by `dist.broadcast_object_list` on the gloo plan group: a pickle turned
into a tensor, two broadcasts (its size, then its bytes) over TCP, and an unpickle on every
rank, on the critical path of every step (CPU, null forward: +0.8 ms a step at tp2, batch 1).
On one node it now goes through a ring in shared memory (`ShmPlanChannel`): a step's plan as
a step frame of int64 words that rank 0 writes straight into the ring (`plan_codec.StepFrame`:
no pickle, one concatenation; 27 KB at batch 256), anything else pickled once and copied in;
every other rank copies the frame out and rebuilds the plan from views of that copy. Multi-node
groups keep the gloo broadcast (`GlooPlanChannel`), as /dev/shm does not span hosts.

What stays as it was: rank 0 is the only writer and every rank reads every message in order
(law 1: the plan is data from the one decider; the mirror check of `plan_codec` runs on what
was read, law 4). A rank waits for the next message without a deadline (an idle server sends
nothing), yet notices the driver's death at once: it sleeps in a read of its doorbell, a FIFO
whose only writer is rank 0, so the read ends (end of file) when rank 0's process is gone.

Ring protocol (one writer, R readers, byte offsets that only grow): the writer copies a frame
(8-byte length, then the payload) at `head % capacity`, then stores the new `head`; reader i
copies from its `tail_i` up to `head` and stores its new `tail_i`. The writer never overwrites
bytes a reader has not passed (it waits for the slowest reader, with a deadline), and a frame
larger than the ring streams through it in pieces. The data is mapped twice, back to back
(`_map_twice`), so a frame that fits the ring is one piece wherever it starts. A reader that
finds nothing spins for `spin_s` (yielding its core), then sets its `waiting` flag and sleeps
on its doorbell; the writer rings the bell of every waiting reader after it publishes. Both
sides put a full memory fence between their store and their load of the other's word (a Dekker
handshake), so a reader never sleeps past a published message. The fence is an uncontended
lock's acquire and release (a locked instruction on x86-64, where aligned 8-byte stores are
atomic).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import shutil
import struct
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist

from phaseflip.distributed.plan_codec import StepFrame, decode_frame, is_frame

RING_BYTES = 8 << 20  # a decode plan at batch 256 is ~40 KiB; a checked one ~2 MiB at 1k ctx
# A reader's busy wait (yielding its core to anything runnable) before it sleeps on its
# doorbell: at least SPIN_S, and twice the last gap between messages up to SPIN_MAX_S, so a
# busy group never pays a wake-up (a sleeping reader's doorbell cost rank 0 0.4-2 ms a step
# on a loaded 2-core box: the write hands the core to the woken rank). A rank left idle
# sleeps SPIN_MAX_S after the last message at the latest.
SPIN_S = 2e-3
SPIN_MAX_S = 50e-3
PIPE_NAP_MAX_S = 200e-6  # a hand-off's reader past its spin: the longest nap
FULL_RING_STALL_S = 300.0  # how long rank 0 waits for a reader that does not read
_LINE = 64  # each reader's words on their own cache line
_LEN = struct.Struct("<Q")


class DriverGoneError(RuntimeError):
    """Rank 0 closed the plan channel (its process ended) while this rank waited on it."""


class PlanChannel(Protocol):
    """Rank 0 sends; every other rank receives every message, in order."""

    def send(self, msg: object) -> None: ...

    def recv(self) -> object: ...

    def close(self) -> None: ...


def plan_channel(rank: int, world_size: int, ranks_per_node: int,
                 group: dist.ProcessGroup) -> PlanChannel:
    """The channel for this group: shared memory when every rank is on this node, else the
    gloo broadcast on `group` (the plan group, which has no deadline). Nothing is exchanged
    before the first message."""
    if world_size == ranks_per_node:
        return ShmPlanChannel(rank, world_size, group)
    return GlooPlanChannel(group)


class GlooPlanChannel:
    """The broadcast on the plan group (multi-node groups)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, msg: object) -> None:
        dist.broadcast_object_list([msg], src=0, group=self.group)

    def recv(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        pass


class ShmPlanChannel:
    """The ring in shared memory, set up at the first message: rank 0 makes the ring file and
    one doorbell FIFO per reader in a private /dev/shm directory, sends its path over the plan
    group, waits for every rank to open them (a barrier) and unlinks them, so nothing is left
    on the file system even if a process is killed later."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup,
                 capacity: int = RING_BYTES, spin_s: float = SPIN_S,
                 full_stall_s: float = FULL_RING_STALL_S) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.capacity, self.spin_s, self.full_stall_s = capacity, spin_s, full_stall_s
        self.ring: ShmRing | None = None

    def send(self, msg: object) -> None:
        """A step's plan goes as a step frame (`plan_codec.StepFrame`) written straight into
        the ring; anything else pickled."""
        if self.ring is None:
            self.ring = self._create()
        frame = StepFrame.of(msg)
        if frame is not None:
            self.ring.write_into(frame.nbytes, frame.fill)
        else:
            self.ring.write(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> object:
        """The next message; a step frame's arrays are views of its own copy of the bytes."""
        if self.ring is None:
            self.ring = self._attach()
        payload = self.ring.read()
        return decode_frame(payload) if is_frame(payload) else pickle.loads(payload)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None

    def _create(self) -> ShmRing:
        where = tempfile.mkdtemp(prefix="phaseflip-plans-", dir=_shm_dir())
        try:
            readers = self.world_size - 1
            ring = ShmRing.create(where, readers, self.capacity, self.full_stall_s)
            dist.broadcast_object_list([(where, readers, self.capacity)], src=0,
                                       group=self.group)
            dist.barrier(group=self.group)  # every reader has opened the ring and its bell
        finally:
            shutil.rmtree(where, ignore_errors=True)
        return ring

    def _attach(self) -> ShmRing:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)  # no deadline: may be idle
        where, readers, capacity = box[0]
        ring = ShmRing.attach(where, self.rank - 1, readers, capacity, self.spin_s)
        dist.barrier(group=self.group)
        return ring


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class ShmRing:
    """The ring's memory and one side of it: the writer (reader=None) or reader `reader`.

    Control words (uint64, each side's on its own cache line): word 0 is `head` (bytes
    published); reader i's line holds `tail_i` (bytes it consumed) and `waiting_i`."""

    def __init__(self, path: str, readers: int, reader: int | None, bells: list[int],
                 capacity: int, spin_s: float = SPIN_S,
                 full_stall_s: float = FULL_RING_STALL_S, wait_s: float | None = None) -> None:
        """`bells`: the writer's doorbell per reader, or a reader's own; none: a reader naps
        between its checks and gives up after `wait_s` (a step's hand-off, `StagePipes`)."""
        self.readers, self.reader, self.bells = readers, reader, bells
        self.capacity, self.spin_s, self.full_stall_s = capacity, spin_s, full_stall_s
        self.wait_s = wait_s
        header = _header_bytes(readers)
        with open(path, "r+b") as f:
            whole = _map_twice(f.fileno(), header, capacity)
            self.mm = None if whole is not None else mmap.mmap(f.fileno(), header + capacity)
        # twice mapped: data[i] and data[i + capacity] are one byte, so any frame that fits
        # the ring lies in one piece (read in place, written by one copy) wherever it starts
        self.span = 2 * capacity if whole is not None else capacity
        whole = whole if whole is not None else memoryview(self.mm)
        self.ctl = np.frombuffer(whole, dtype=np.uint64, count=header // 8)
        self.data = whole[header:]
        # every page mapped now, not at a step's first pass over it (a plan ring takes ~250
        # decode steps at batch 256 to come round: each would pay its pages' faults)
        pages = np.frombuffer(self.data, dtype=np.uint8)[::mmap.PAGESIZE]
        if reader is None:
            pages[:] = 0  # the writer, before any frame: allocates them
        else:
            int(pages.sum())
        del pages
        self._fence_lock = threading.Lock()
        self.pos = 0  # the writer's unpublished head, or this reader's tail
        self.head_seen = 0  # a reader's last read of `head`
        self.gap_s = 0.0  # a reader's last wait for a message
        self.held = 0  # a reader's tail still to publish, past a payload read in place

    @classmethod
    def create(cls, where: str, readers: int, capacity: int,
               full_stall_s: float = FULL_RING_STALL_S, doorbells: bool = True) -> ShmRing:
        path = os.path.join(where, "ring")
        with open(path, "wb") as f:
            f.truncate(_header_bytes(readers) + capacity)
        bells = []
        for i in range(readers if doorbells else 0):
            bell = os.path.join(where, f"bell{i}")
            os.mkfifo(bell, 0o600)
            # read-write: opening never blocks, and this process stays the FIFO's writer
            bells.append(os.open(bell, os.O_RDWR | os.O_NONBLOCK))
        return cls(path, readers, None, bells, capacity, full_stall_s=full_stall_s)

    @classmethod
    def attach(cls, where: str, reader: int, readers: int, capacity: int,
               spin_s: float = SPIN_S) -> ShmRing:
        # read only: when rank 0's process ends, the bell has no writer and a read ends
        bell = os.open(os.path.join(where, f"bell{reader}"), os.O_RDONLY)
        return cls(os.path.join(where, "ring"), readers, reader, [bell], capacity, spin_s)

    def fence(self) -> None:
        with self._fence_lock:
            pass

    # ---------------------------------------------------------------- the writer
    def write(self, payload: bytes) -> None:
        """Copies one frame in and publishes it (waiting only if the ring is full)."""
        self.write_parts([payload])

    def write_parts(self, parts: list[bytes | np.ndarray]) -> None:
        """One frame of the parts' bytes back to back, each copied in once."""
        self._copy_in(_LEN.pack(sum(memoryview(p).nbytes for p in parts)))
        for p in parts:
            self._copy_in(p)
        self._publish()

    def write_into(self, n: int, fill: Callable[[memoryview], None]) -> None:
        """Writes one n-byte frame by `fill(buffer)`: in place in the ring when it lies in one
        piece and the readers have left room for it, else through a copy (and waits)."""
        self._copy_in(_LEN.pack(n))
        at, cap = self.pos % self.capacity, self.capacity
        if at + n <= self.span and cap - (self.pos - self._slowest_tail()) >= n:
            fill(self.data[at : at + n])
            self.pos += n
        else:
            buf = bytearray(n)
            fill(memoryview(buf))
            self._copy_in(buf)
        self._publish()

    def _copy_in(self, buf: bytes) -> None:
        mv, off, cap = memoryview(buf), 0, self.capacity
        while off < len(mv):
            free = cap - (self.pos - self._slowest_tail())
            if free == 0:
                self._publish()  # let the readers drain what is written so far
                self._wait_for_space()
                continue
            at = self.pos % cap
            k = min(free, len(mv) - off, self.span - at)
            self.data[at : at + k] = mv[off : off + k]
            self.pos += k
            off += k

    def _slowest_tail(self) -> int:
        return int(min(self.ctl[_LINE // 8 * (i + 1)] for i in range(self.readers)))

    def _publish(self) -> None:
        self.ctl[0] = self.pos
        self.fence()  # the head store before the loads of the waiting flags
        for i in range(self.readers):
            if self.ctl[_LINE // 8 * (i + 1) + 1]:
                try:
                    os.write(self.bells[i], b"\x01")
                except BlockingIOError:  # its pipe is full of rings: it is awake anyway
                    pass

    def _wait_for_space(self) -> None:
        deadline, nap = time.monotonic() + self.full_stall_s, 20e-6
        while self.capacity - (self.pos - self._slowest_tail()) == 0:
            if time.monotonic() > deadline:
                behind = [i + 1 for i in range(self.readers)
                          if int(self.ctl[_LINE // 8 * (i + 1)]) < self.pos - self.capacity + 1]
                raise TimeoutError(f"the plan channel is full: rank(s) {behind} read nothing "
                                   f"for {self.full_stall_s:g} s")
            time.sleep(nap)
            nap = min(2 * nap, 1e-3)

    # ---------------------------------------------------------------- a reader
    def read(self, view: bool = False) -> bytearray | memoryview:
        """The next frame's payload (waits for it without a deadline). `view` (a ring's only
        reader): the payload in place when it lies in one piece, valid until this reader's
        next `read` (its bytes are released to the writer only then); else a copy."""
        self._release()
        (n,) = _LEN.unpack(self._copy_out(_LEN.size))
        at = self.pos % self.capacity
        if (not view or self.readers != 1 or n == 0 or n > self.capacity
                or at + n > self.span):  # larger than the ring: it streams through
            return self._copy_out(n)
        while self.head_seen < self.pos + n:  # the whole frame fits: it is published whole
            self._wait_for_data()
        self.pos += n
        self.held = self.pos
        return self.data[at : at + n]

    def _release(self) -> None:
        if self.held:
            self.ctl[_LINE // 8 * (self.reader + 1)] = self.held
            self.held = 0

    def _copy_out(self, n: int) -> bytearray:
        out, off, cap = bytearray(n), 0, self.capacity
        tail_word = _LINE // 8 * (self.reader + 1)
        while off < n:
            if self.head_seen == self.pos:
                self._wait_for_data()
            at = self.pos % cap
            k = min(self.head_seen - self.pos, n - off, self.span - at)
            out[off : off + k] = self.data[at : at + k]
            self.pos += k
            off += k
            self.ctl[tail_word] = self.pos  # free it at once: a large frame streams through
        return out

    def _wait_for_data(self) -> None:
        waiting = _LINE // 8 * (self.reader + 1) + 1
        start = time.perf_counter()
        spin_end = start + max(self.spin_s, min(2 * self.gap_s, SPIN_MAX_S))
        while True:
            head = int(self.ctl[0])
            if head > self.pos:
                self.head_seen = head
                self.gap_s = time.perf_counter() - start
                return
            if time.perf_counter() < spin_end:
                os.sched_yield()
                continue
            if not self.bells:
                return self._nap_for_data()
            self.ctl[waiting] = 1
            self.fence()  # the flag store before the head load
            head = int(self.ctl[0])
            if head <= self.pos and not os.read(self.bells[0], 4096):
                raise DriverGoneError("rank 0 closed the plan channel: the driver is gone")
            self.ctl[waiting] = 0

    def _nap_for_data(self) -> None:
        """A reader without a doorbell (a step's hand-off), past its spin (`_wait_for_data`):
        naps of growing length, at most PIPE_NAP_MAX_S each, up to `wait_s` in all (naps
        doubling to 1 ms overslept a hand-off by up to that much)."""
        deadline, nap = time.monotonic() + (self.wait_s or FULL_RING_STALL_S), 20e-6
        while (head := int(self.ctl[0])) <= self.pos:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no data from the peer in {self.wait_s:g} s")
            time.sleep(nap)
            nap = min(2 * nap, PIPE_NAP_MAX_S)
        self.head_seen = head

    def close(self) -> None:
        for fd in self.bells:
            os.close(fd)
        self.bells = []
        del self.ctl
        if self.mm is None:  # unmapped when the last view of it goes (`_map_twice`)
            del self.data
            return
        try:
            self.data.release()
            self.mm.close()
        except BufferError:  # a payload read in place is still referenced: unmapped with it
            pass


def _map_twice(fd: int, header: int, capacity: int) -> memoryview | None:
    """The ring file (`header` bytes, then `capacity` of data) mapped with its data a second
    time right after the first: one piece of `header + 2 * capacity` bytes. None where that
    cannot be done (not Linux, sizes not in pages): the caller maps it once. The mapping is
    undone when the last view of it is gone (a payload read in place may outlive the ring)."""
    page = mmap.PAGESIZE
    if not sys.platform.startswith("linux") or capacity % page or header % page:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    map_, unmap = libc.mmap, libc.munmap
    map_.restype = ctypes.c_void_p
    map_.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                     ctypes.c_int, ctypes.c_long]
    unmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total, rw = header + 2 * capacity, mmap.PROT_READ | mmap.PROT_WRITE
    base = map_(None, total, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    if base is None or base == ctypes.c_void_p(-1).value:
        return None
    second = base + header + capacity
    fixed = mmap.MAP_SHARED | _MAP_FIXED
    if (map_(base, header + capacity, rw, fixed, fd, 0) != base
            or map_(second, capacity, rw, fixed, fd, header) != second):
        unmap(base, total)
        return None
    buf = (ctypes.c_ubyte * total).from_address(base)
    weakref.finalize(buf, unmap, base, total).atexit = False  # the exit unmaps it anyway
    return memoryview(buf).cast("B")


_MAP_FIXED = 0x10  # Linux's MAP_FIXED (the mmap module does not export it)


def _header_bytes(readers: int) -> int:
    return -(-_LINE * (readers + 1) // 4096) * 4096  # page-aligned data


PIPE_BYTES = 16 << 20  # a ring per (sender, receiver) pair that hands tensors over
_PATH_BYTES = 256


class StagePipes:
    """Tensors staged on the host (gloo groups: hidden states to the next stage, logits to
    rank 0) between ranks of one node, through a ring per (sender, receiver) pair instead of
    gloo's TCP send/receive: one copy in, one copy out, no socket or gloo thread hop. A pair's
    ring is made by its sender at its first hand-off (the path goes over `group` by a gloo
    send, the receiver acknowledges, the file is unlinked) and lives as long as this object.

    A hand-off belongs to a step, so both sides wait with the group's deadline (law 3: a
    peer that never sends is a named stall, never a hang), and a receiver naps rather than
    sleeps on a doorbell. A sender only waits when the ring is full of what the receiver has
    not read yet, which the receiver reads without waiting on the sender (stages form a
    chain; the logits go back only after every micro-batch was handed on)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float,
                 capacity: int = PIPE_BYTES) -> None:
        self.group, self.timeout_s, self.capacity = group, timeout_s, capacity
        self.out: dict[int, ShmRing] = {}
        self.inp: dict[int, ShmRing] = {}

    def send(self, t: torch.Tensor, dst: int) -> None:
        self.send_parts([t], dst)

    def send_parts(self, parts: list[torch.Tensor], dst: int) -> None:
        """The parts' bytes back to back as one hand-off (received as one tensor)."""
        ring = self.out.get(dst) or self._open_out(dst)
        ring.write_parts([t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                          for t in parts])

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        """The tensor in place in the ring (no copy) when it lies in one piece: valid until
        the next `recv` from `src`, by when the caller has used it (a stage's micro-batch
        runs before the next one is received; rank 0 samples a step's logits before the
        next step's arrive)."""
        ring = self.inp.get(src) or self._open_in(src)
        raw = ring.read(view=True)
        if not len(raw):
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).view(shape)

    def _open_out(self, dst: int) -> ShmRing:
        where = tempfile.mkdtemp(prefix="phaseflip-pipe-", dir=_shm_dir())
        try:
            ring = ShmRing.create(where, 1, self.capacity, self.timeout_s, doorbells=False)
            path = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
            path[: len(where)] = torch.tensor(list(where.encode()), dtype=torch.uint8)
            dist.send(path, dst, group=self.group)
            dist.recv(torch.zeros(_PATH_BYTES, dtype=torch.uint8), dst, group=self.group)
        finally:
            shutil.rmtree(where, ignore_errors=True)
        self.out[dst] = ring
        return ring

    def _open_in(self, src: int) -> ShmRing:
        path = torch.zeros(_PATH_BYTES, dtype=torch.uint8)
        dist.recv(path, src, group=self.group)
        where = bytes(path.tolist()).rstrip(b"\0").decode()
        ring = ShmRing(os.path.join(where, "ring"), 1, 0, [], self.capacity, SPIN_S,
                       wait_s=self.timeout_s)
        dist.send(torch.ones(_PATH_BYTES, dtype=torch.uint8), src, group=self.group)
        self.inp[src] = ring
        return ring

    def close(self) -> None:
        for ring in [*self.out.values(), *self.inp.values()]:
            ring.close()
        self.out, self.inp = {}, {}
