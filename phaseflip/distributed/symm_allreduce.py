"""Small TP all-reduces over symmetric memory: the decode step's 2 × layers messages of a few
KiB each, where NCCL's per-call latency (17 µs on the H200 pair) dominates.

How it works. At launch every rank allocates one peer-mappable buffer per layout with TP
(`_SymmetricMemory.empty_strided_p2p`) and maps its TP peers' buffers into its address space
(`rendezvous`: CUDA VMM handles exchanged over a Unix socket, metadata over the group's
store). An all-reduce then copies its input into the rank's own buffer and runs one of
PyTorch's kernels, which wait at a barrier on signal pads in the same allocation, read every
peer's buffer over NVLink and sum. `one_shot_all_reduce` (each rank reads every peer's whole
message) for two ranks at any size (two-shot would move the same bytes with one barrier more)
and up to ONE_SHOT_MAX_BYTES for more ranks; `two_shot_all_reduce_` (reduce-scatter, then
all-gather, in place) above that.
Never the multimem (NVLink multicast) variants, and the rendezvous maps no multicast object
(TORCH_SYMM_MEM_DISABLE_MULTICAST): docs/troubleshooting.md says why multicast stays off.

What goes this way: sum all-reduces of contiguous, 16-byte aligned bfloat16 or float32 tensors
on the buffer's device whose size is a multiple of 4 bytes and at most the buffer
(--all-reduce-max-kib; `symm_routes`).
float16 is not among them: torch's kernels dispatch float and bfloat16 only. Everything else,
and every other collective (all_reduce_max, gather), is the process-group path unchanged.

CUDA graphs. The kernels are capturable as they are: the buffer and the signal pads are
allocated and mapped once at launch and never move, so a captured copy-in and kernel read
the same addresses at every replay; the barrier's signal pads are reset by the kernel that
waits on them, so replays need no host work. Nothing may rendezvous or allocate while a graph
is being captured — nothing here does after launch.

One stream at a time: every call on a rank shares the buffer and the signal pads (as every
call on an NCCL communicator shares its channels), so two all-reduces of a group must never
run concurrently on two streams.

Ranks sharing one GPU (correctness runs over gloo): torch maps a peer's allocation on the same
device once TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES is set, which `--all-reduce symm-mem`
does there. The GPU then time-slices the two ranks' kernels, each spinning at the barrier
until the other runs: right answers (what tests/test_symm_allreduce.py checks there),
meaningless times. The rendezvous needs no NCCL: it reads
the TP group's store, so a gloo group serves (torch >= 2.11 resolves the group by name; the
deprecated `enable_symm_mem_for_group` is not called: in 2.13 it makes every call check the
buffer's id over the store).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from phaseflip.layout import ProcessGroupCommunicator

log = logging.getLogger(__name__)


class LaunchSpec(Protocol):
    """What the launch reads of `group.DistSpec` (a protocol, so that group.py, which calls
    this module, is not imported back)."""

    all_reduce: str
    device: str
    ranks_per_node: int
    world_size: int
    node_rank: int
    all_reduce_max_bytes: int

MODES = ("nccl", "symm-mem", "auto")
SYMM_DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernels dispatch
ONE_SHOT_MAX_BYTES = 512 << 10  # more than two ranks: one-shot up to here, two-shot above
NO_MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
SHARED_DEVICE_ENV = "TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"
PROBE_DEADLINE_S = 60.0  # the launch probe; torch's barrier itself has no deadline
_REQUIRED_OPS = ("one_shot_all_reduce_out", "two_shot_all_reduce_")
# the one-shot kernel that copies its input in itself (a launch fewer); older torch lacks it
_COPY_IN_OP = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")

Layout2 = tuple[int, int]  # (tp, pp)


@dataclass(frozen=True)
class SymmBuffer:
    """One rank's rendezvoused buffer for one TP group: `data` (uint8, `data.numel()` bytes)
    is mapped by every peer of the group named `group_name` for the life of the process."""

    data: torch.Tensor
    group_name: str

    @property
    def max_bytes(self) -> int:
        return self.data.numel()


def symm_routes(x: torch.Tensor, max_bytes: int) -> bool:
    """Whether a sum all-reduce of `x` goes over symmetric memory (`max_bytes`: the buffer).
    Its address must be 16-byte aligned: the kernels store the result in vectors as wide as
    the buffer's alignment and check only the input's (a misaligned output is a fault)."""
    nbytes = x.numel() * x.element_size()
    return (x.dtype in SYMM_DTYPES and x.is_contiguous() and 0 < nbytes <= max_bytes
            and nbytes % 4 == 0 and x.data_ptr() % 16 == 0)


def one_shot_limit(size: int) -> float:
    """Largest message (bytes) for the one-shot kernel in a group of `size` ranks: any for
    two (two-shot moves the same bytes per rank with one barrier more), ONE_SHOT_MAX_BYTES
    for more, where two-shot reads only its share from each peer."""
    return math.inf if size == 2 else ONE_SHOT_MAX_BYTES


@dataclass(frozen=True, eq=False)
class SymmMemCommunicator(ProcessGroupCommunicator):
    """The process-group communicator whose small sum all-reduces go over symmetric memory.

    It is a ProcessGroupCommunicator, so every other collective, every message that does not
    route (`symm_routes`) and `staged` (the runner captures no graphs on a staged group) keep
    their meaning. `buffer` is on this rank's device; calls run on the current stream."""

    buffer: SymmBuffer | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer
        if buf is None or not x.is_cuda or not symm_routes(x, buf.max_bytes):
            return super().all_reduce(x)
        flat = x.view(-1)
        view = buf.data.view(x.dtype)[: flat.numel()]
        ops = torch.ops.symm_mem
        if x.numel() * x.element_size() <= one_shot_limit(self.size):
            if _COPY_IN_OP and _copy_in_kernel(flat):
                ops.one_shot_all_reduce_copy_out(view, flat, "sum", buf.group_name, flat)
            else:
                view.copy_(flat)
                ops.one_shot_all_reduce_out(view, "sum", buf.group_name, flat)
        else:
            view.copy_(flat)
            ops.two_shot_all_reduce_(view, "sum", buf.group_name)
            flat.copy_(view)
        return x

    def graph_addresses(self) -> tuple[int, ...]:
        """The device memory a captured all-reduce reads besides its input: the buffer (made
        once at launch, so parked decode graphs of this layout stay valid across flips)."""
        return (self.buffer.data.data_ptr(), self.buffer.max_bytes) if self.buffer else ()


def all_reduce_path(runner: object) -> str | None:
    """The TP all-reduce of `runner`'s layout, as /server_info reports it (None: no TP). A
    driver's runner holds rank 0's model runner as `.runner`."""
    layout = getattr(getattr(runner, "runner", runner), "layout", None)
    comm = getattr(layout, "tp_comm", None)
    if isinstance(comm, SymmMemCommunicator) and comm.buffer is not None:
        return f"symm-mem (up to {comm.buffer.max_bytes >> 10} KiB, the process group above)"
    if isinstance(comm, ProcessGroupCommunicator):
        return "gloo" if comm.staged else "nccl"
    return None


def _copy_in_kernel(flat: torch.Tensor) -> bool:
    """The one-shot kernel copies the input in itself (a launch fewer) only when the input's
    offset is as aligned as the buffer's (16 bytes), which torch checks."""
    return flat.storage_offset() * flat.element_size() % 16 == 0


def communicator(fallback: ProcessGroupCommunicator,
                 buffer: SymmBuffer | None) -> ProcessGroupCommunicator:
    """The TP communicator of a layout: `fallback` itself when symmetric memory is off."""
    if buffer is None:
        return fallback
    return SymmMemCommunicator(fallback.group, fallback.size, fallback.staged, buffer)


# ---- the launch: which path, and the rendezvous ----------------------------------------


def wanted(mode: str, device: str, ranks_per_node: int, world_size: int,
           gpus: int) -> tuple[bool, str]:
    """Whether to try symmetric memory, and why (or why not), from what every rank of a node
    sees alike (so all of them decide the same without a collective). `auto` tries it when
    every rank has its own GPU on one node; `symm-mem` also when ranks share a GPU."""
    if mode not in MODES:
        raise ValueError(f"all_reduce={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "nccl":
        return False, "--all-reduce nccl"
    if device == "cpu" or gpus == 0:
        return False, "no CUDA device: the ranks run on the CPU"
    if ranks_per_node != world_size:
        return False, f"the ranks span {world_size // ranks_per_node} nodes"
    if gpus < ranks_per_node and mode == "auto":
        return False, (f"{ranks_per_node} ranks share {gpus} GPU(s); --all-reduce symm-mem "
                       "forces it there")
    return True, mode


def _local_check(device: torch.device, peers: Iterable[torch.device]) -> str | None:
    """Why this rank cannot run torch's symmetric-memory all-reduce (None: it can)."""
    missing = [op for op in _REQUIRED_OPS if not hasattr(torch.ops.symm_mem, op)]
    if missing:
        return f"torch {torch.__version__} lacks torch.ops.symm_mem.{missing[0]}"
    if not hasattr(torch._C._distributed_c10d, "_SymmetricMemory"):
        return f"torch {torch.__version__} has no symmetric memory"
    for peer in peers:
        if peer != device and not torch.cuda.can_device_access_peer(device, peer):
            return f"{device} has no peer access (P2P) to {peer}"
    return None


def _rendezvous(group: dist.ProcessGroup, nbytes: int, device: torch.device) -> SymmBuffer:
    """The buffer, mapped by every rank of `group` (a collective of the group), then checked
    with one all-reduce against the known sum. Outside the caching allocator on purpose:
    its pools (expandable segments with flips) never see this allocation."""
    from torch.distributed._symmetric_memory import _SymmetricMemory, rendezvous

    data = _SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8, device)
    rendezvous(data, group.group_name)
    buf = SymmBuffer(data, group.group_name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    probe = SymmMemCommunicator(group, size, buffer=buf)
    x = torch.full((256,), float(rank + 1), device=device)
    probe.all_reduce(x)
    _await_probe(device)
    want = size * (size + 1) / 2
    if not bool((x == want).all()):
        raise RuntimeError(f"the probe all-reduce summed to {x[0].item()}, not {want}")
    return buf


def _await_probe(device: torch.device, deadline_s: float = PROBE_DEADLINE_S) -> None:
    """Wait for the probe with a deadline: torch's barrier spins on the GPU with none, so a
    peer that died after the rendezvous would otherwise hang this launch in a synchronize,
    before the agreement that turns the layout to the process group."""
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > deadline_s:
            raise RuntimeError(f"the probe all-reduce did not finish in {deadline_s:.0f} s "
                               "(a peer stopped after the rendezvous?)")
        time.sleep(0.001)


@dataclass(frozen=True)
class SymmSetup:
    """What the launch chose: a buffer per layout where symmetric memory is on (None: the
    process-group path), and the line the launch logs."""

    buffers: dict[Layout2, SymmBuffer | None]
    line: str

    def path(self, layout: Layout2) -> str:
        return "symm-mem" if self.buffers.get(layout) is not None else "nccl"


def setup_symm_all_reduce(rank: int, spec: LaunchSpec,
                          tp_groups: dict[Layout2, dist.ProcessGroup | None],
                          cpu_group: dist.ProcessGroup) -> SymmSetup:
    """Rendezvous for this rank's TP group of every layout (every rank calls it at launch, in
    the same order). No collective runs unless `wanted` says to try. Any failure on any rank
    (a missing op, no P2P, a rendezvous or probe error) is agreed over `cpu_group` and turns
    that layout, or all of them, to the process-group path with the reason in the line; it
    never stops the launch."""
    mode = spec.all_reduce
    gpus = torch.cuda.device_count() if spec.device != "cpu" and mode != "nccl" else 0
    go, why = wanted(mode, spec.device, spec.ranks_per_node, spec.world_size, gpus)
    if not go:
        return SymmSetup(dict.fromkeys(tp_groups), f"all-reduce path: nccl ({why})")
    first = spec.node_rank * spec.ranks_per_node

    def device(r: int) -> torch.device:  # as group.rank_device places ranks
        return torch.device("cuda", (r - first) % gpus)

    os.environ.setdefault(NO_MULTICAST_ENV, "1")
    peers = [device(r) for tp, _ in tp_groups for r in tp_members(rank, tp)]
    if len({device(r) for r in range(first, first + spec.ranks_per_node)}) < spec.ranks_per_node:
        os.environ[SHARED_DEVICE_ENV] = "1"  # ranks share a GPU: torch refuses unless told
    problem = _local_check(device(rank), peers)
    if problem is not None:
        log.warning("rank %d cannot use symmetric memory: %s", rank, problem)
    if not all_ranks(problem is None, cpu_group):
        why = problem or "another rank cannot use symmetric memory"
        return SymmSetup(dict.fromkeys(tp_groups), f"all-reduce path: nccl ({mode}: {why})")
    nbytes = spec.all_reduce_max_bytes

    def attempt(group: dist.ProcessGroup) -> SymmBuffer:
        with torch.cuda.device(device(rank)):
            return _rendezvous(group, nbytes, device(rank))

    buffers, notes = agree_per_layout(tp_groups, cpu_group, attempt)
    line = (f"all-reduce path ({mode}): " + "; ".join(notes)
            + f" (symm-mem takes messages up to {nbytes >> 10} KiB)")
    return SymmSetup(buffers, line)


def tp_members(rank: int, tp: int) -> list[int]:
    """Global ranks of `rank`'s TP group in a layout of `tp` TP ranks (group.rank_coords)."""
    stage = rank // tp
    return [stage * tp + t for t in range(tp)] if tp > 1 else []


def all_ranks(ok: bool, cpu_group: dist.ProcessGroup) -> bool:
    """Whether `ok` holds on every rank of `cpu_group` (a collective)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def agree_per_layout(tp_groups: dict[Layout2, dist.ProcessGroup | None],
                     cpu_group: dist.ProcessGroup,
                     attempt: Callable[[dist.ProcessGroup], SymmBuffer],
                     ) -> tuple[dict[Layout2, SymmBuffer | None], list[str]]:
    """`attempt` for this rank's TP group of each layout, then one agreement per layout: a
    layout runs symm-mem only where every rank's attempt succeeded. Without it, a rank whose
    rendezvous failed would call NCCL while its peers spin in the symm-mem barrier: a hang."""
    buffers: dict[Layout2, SymmBuffer | None] = {}
    notes = []
    for (tp, pp), group in tp_groups.items():
        buf, problem = None, None
        if group is not None:
            try:
                buf = attempt(group)
            except Exception as e:  # noqa: BLE001 — any failure falls back, agreed below
                problem = f"{type(e).__name__}: {e}".strip().splitlines()[0]
                log.warning("symm-mem rendezvous of tp%d×pp%d failed on this rank: %s",
                            tp, pp, problem)
        ok = all_ranks(problem is None, cpu_group) and group is not None
        buffers[(tp, pp)] = buf if ok else None
        why = ("no TP" if group is None else "symm-mem" if ok
               else f"nccl ({problem or 'another rank failed its rendezvous'})")
        notes.append(f"tp{tp}×pp{pp} {why}")
    return buffers, notes
