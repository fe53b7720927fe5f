"""Ranks and process groups of one tensor×pipeline layout.

Global rank r = pp_rank * tp_size + tp_rank. Rank 0 (stage 0, TP rank 0) is the driver. Every
rank creates every group in the same order (a torch.distributed requirement); the groups are
held by a `RankGroups` object, never in module globals, so a later layout can replace them.

Two deadlines, on purpose. Collectives inside a step (TP all-reduces, PP sends, the HiCache
fence) carry `--dist-timeout-s`: a peer that does not answer while there is work is a stall.
The wait for the *next* message from the driver carries none (`plan_group`): an idle server
sends nothing, and a rank must be able to wait for it forever (with the group timeout on that
wait, every multi-rank server died after two idle minutes). A driver that wedges while it has
work is caught on the driver's side, by the engine's step watchdog; a driver that dies closes
its sockets (the wait then fails at once) or is noticed by the rank's parent check.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from phaseflip.config import EngineConfig
from phaseflip.distributed.rendezvous import (
    GroupFormationError,
    NodeCheckIns,
    agreed_flags,
    split_addr,
)
from phaseflip.distributed.symm_allreduce import (
    SymmBuffer,
    SymmSetup,
    communicator,
    setup_symm_all_reduce,
)
from phaseflip.errors import InvalidRequestError
from phaseflip.layout import Layout, ProcessGroupCommunicator
from phaseflip.model.config import ModelConfig

log = logging.getLogger(__name__)


def rank_coords(rank: int, tp_size: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank."""
    return rank % tp_size, rank // tp_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class DistSpec:
    """Everything a rank needs to join the group (picklable, sent to spawned ranks)."""

    world_size: int
    tp_size: int
    pp_size: int
    init_addr: str  # host:port of rank 0
    backend: str  # gloo or nccl
    timeout_s: float
    ranks_per_node: int
    node_rank: int
    hicache_frames: str | None = None  # path of the node's shared HiCache host frames
    weight_image: str | None = None  # path of the node's host weight image (flip weights)
    # every (tp, pp) the ranks may run: their communicators are made at launch, none at a seam
    layouts: tuple[tuple[int, int], ...] = ()
    all_reduce: str = "nccl"  # --all-reduce: nccl, symm-mem or auto (symm_allreduce.py)
    device: str = "cpu"  # --device (symm-mem needs the ranks on GPUs)
    all_reduce_max_bytes: int = 0  # the symm-mem buffer: larger messages take the group
    # host-staged hand-offs within a node through shared-memory pipes (False: the
    # point-to-point path NCCL takes, forced on gloo by NO_STAGE_PIPES_ENV for its tests)
    stage_pipes: bool = True
    # what every node must have in common, checked in with rank 0 (`rendezvous.py`)
    agreement: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_config(cls, cfg: EngineConfig, model_cfg: ModelConfig) -> DistSpec:
        addr = cfg.dist_init_addr or f"127.0.0.1:{free_port()}"
        split_addr(addr)  # a malformed --dist-init-addr is named before any rank starts
        per_node = cfg.world_size // cfg.nnodes
        backend = dist_backend(cfg)
        return cls(cfg.world_size, cfg.tp_size, cfg.pp_size, addr, backend,
                   cfg.dist_timeout_s, per_node, cfg.node_rank,
                   layouts=runnable_layouts(cfg, model_cfg), all_reduce=cfg.all_reduce,
                   device=cfg.device,
                   all_reduce_max_bytes=cfg.all_reduce_max_kib << 10,
                   stage_pipes=not os.environ.get(NO_STAGE_PIPES_ENV),
                   agreement=agreed_flags(cfg, model_cfg, backend) if cfg.nnodes > 1 else ())

    @property
    def nnodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def with_layout(self, tp_size: int, pp_size: int) -> DistSpec:
        return dataclasses.replace(self, tp_size=tp_size, pp_size=pp_size)

    def local_ranks(self) -> range:
        start = self.node_rank * self.ranks_per_node
        return range(start, start + self.ranks_per_node)


# Tests and benchmarks only: set in the engine process before its ranks are spawned, gloo
# ranks of one node hand tensors over by point-to-point as NCCL ranks do (`DistSpec`).
NO_STAGE_PIPES_ENV = "PHASEFLIP_NO_STAGE_PIPES"


def dist_backend(cfg: EngineConfig) -> str:
    """--dist-backend resolved: NCCL when every local rank has a GPU of its own, else gloo
    (CPU ranks, or several ranks sharing a GPU, staging their tensors through the host)."""
    if cfg.dist_backend != "auto":
        return cfg.dist_backend
    per_node = cfg.world_size // cfg.nnodes
    gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
    return "nccl" if gpus >= per_node and cfg.device != "cpu" else "gloo"


def check_layouts(cfg: EngineConfig, model_cfg: ModelConfig) -> None:
    """InvalidRequestError (a ValueError) naming why the launch layout, or a flip layout the
    engine was told to use (--flip-layouts, or the auto policy's default tpW/ppW), cannot hold
    the model: checked before any rank starts, by the driver and by every other host's `serve
    --node-rank` (and by `serve`'s launcher before the engine process starts)."""
    misfit = model_cfg.layout_error(cfg.tp_size, cfg.pp_size)
    if misfit is not None:
        raise InvalidRequestError(misfit, "tp_size" if "tp_size" in misfit else "pp_size")
    if not cfg.enable_flip or not (cfg.flip_layouts or cfg.flip_policy == "auto"):
        return
    for tp, pp in cfg.flip_layout_pair:
        misfit = model_cfg.layout_error(tp, pp)
        if misfit is None:
            continue
        w = cfg.world_size
        if cfg.flip_layouts:
            raise InvalidRequestError(
                f"--flip-layouts {cfg.flip_layouts}: tp{tp}×pp{pp}: {misfit}", "flip_layouts")
        raise InvalidRequestError(
            f"--flip-policy auto flips to tp{tp}×pp{pp} (the default --flip-layouts tp{w},pp{w}): "
            f"{misfit}; pass --flip-layouts with two layouts the model can hold", "flip_layouts")


def runnable_layouts(cfg: EngineConfig, model_cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """The launch layout first; with flips on, also the two --flip-layouts when given (a flip
    elsewhere is refused before its seam), else every tp × pp of the same ranks that the model
    can hold (a manual flip may go to any of them; pp8 of a 4-layer model is not built, which
    the warm-up would otherwise fail on every rank)."""
    w, launch = cfg.world_size, (cfg.tp_size, cfg.pp_size)
    if not cfg.enable_flip:
        return (launch,)
    others = (cfg.flip_layout_pair if cfg.flip_layouts
              else tuple((tp, w // tp) for tp in range(1, w + 1)
                         if w % tp == 0 and model_cfg.layout_error(tp, w // tp) is None))
    return (launch, *(lay for lay in others if lay != launch))


@dataclass
class RankGroups:
    rank: int
    spec: DistSpec
    tp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup  # gloo group of all ranks, with the deadline (fences, slots)
    plan_group: dist.ProcessGroup  # gloo group of all ranks without a deadline: the plans
    symm: SymmBuffer | None = None  # the TP all-reduce's symmetric memory (None: the group)
    # rank 0 and the last stage's TP rank 0 (None elsewhere, and for pp 1): the logits
    logits_group: dist.ProcessGroup | None = None

    @property
    def tp_rank(self) -> int:
        return rank_coords(self.rank, self.spec.tp_size)[0]

    @property
    def pp_rank(self) -> int:
        return rank_coords(self.rank, self.spec.tp_size)[1]

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the same TP rank in another stage."""
        return pp_rank * self.spec.tp_size + self.tp_rank

    def layout(self) -> Layout:
        comm = (communicator(ProcessGroupCommunicator(self.tp_group, self.spec.tp_size,
                                                      staged=self.spec.backend == "gloo"),
                             self.symm)
                if self.spec.tp_size > 1 else None)
        kwargs = {"tp_comm": comm} if comm is not None else {}
        return Layout(self.tp_rank, self.spec.tp_size, self.pp_rank, self.spec.pp_size, **kwargs)


# How long a rank waits for the driver's next message: no deadline in practice (gloo takes a
# finite timeout; a year is far beyond any server's idle spell and far below its int64 range).
IDLE_WAIT = datetime.timedelta(days=365)


@dataclass
class Fabric:
    """One rank's communicators for every layout it may run, made once at launch: the world's
    CPU and plan groups, and its TP group in each layout. A phase flip picks another layout's
    `RankGroups` from it; nothing is created or destroyed at the seam."""

    rank: int
    spec: DistSpec
    cpu_group: dist.ProcessGroup
    plan_group: dist.ProcessGroup
    tp_groups: dict[tuple[int, int], dist.ProcessGroup | None]
    symm: SymmSetup | None = None  # each layout's all-reduce path, chosen at launch
    # per PP layout, the logits' own group (`logits_groups`); None where this rank is not in it
    logits: dict[tuple[int, int], dist.ProcessGroup | None] = dataclasses.field(
        default_factory=dict)

    def groups(self, tp_size: int, pp_size: int) -> RankGroups:
        if (tp_size, pp_size) not in self.tp_groups:
            raise ValueError(f"tp{tp_size}×pp{pp_size} is not among the layouts these ranks "
                             f"were launched for: {sorted(self.tp_groups)}")
        symm = self.symm.buffers.get((tp_size, pp_size)) if self.symm else None
        return RankGroups(self.rank, self.spec.with_layout(tp_size, pp_size),
                          self.tp_groups[(tp_size, pp_size)], self.cpu_group, self.plan_group,
                          symm, self.logits.get((tp_size, pp_size)))


JOIN_KEY = "phaseflip/joined/"
# A live rank may take long to arrive (a loaded host importing torch, another node started by
# hand): it is waited for at least this long; a local rank that dies is named at once.
JOIN_FLOOR_S = 300.0


def join(rank: int, spec: DistSpec,
         peers_failed: Callable[[], list[str]] | None = None) -> Fabric:
    """init_process_group for this rank, then every group of every layout in `spec.layouts`
    (TP groups), the CPU group and the plan group (the same gloo ranks, without a deadline:
    see the module docstring). Every rank creates them in the same order. Then the TP
    all-reduce's symmetric memory of every layout (`--all-reduce`), so no seam makes any.

    Rank 0 hosts the rendezvous store and waits for every rank to check in before it forms
    the group, asking `peers_failed` (its local workers that exited) every 0.1 s: a rank that
    dies while joining is a named `GroupFormationError` at once, not a store timeout minutes
    later; a live rank that never arrives is one after --dist-timeout-s (at least
    JOIN_FLOOR_S), naming who is missing. With --nnodes > 1 it also answers each other
    node's check-in (`rendezvous.NodeCheckIns`): a node started with other flags is a
    named `GroupFormationError` on both sides before any of its ranks starts, and a node
    that has not checked in after --dist-timeout-s is one naming the node."""
    host, port = split_addr(spec.init_addr)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    store = dist.TCPStore(host, port, spec.world_size, is_master=rank == 0,
                          timeout=timeout, wait_for_workers=False)
    store.set(f"{JOIN_KEY}{rank}", "1")
    if rank == 0:
        _await_ranks(store, spec, peers_failed or (lambda: []))
    dist.init_process_group(spec.backend, store=store, rank=rank,
                            world_size=spec.world_size, timeout=timeout)
    tp_groups: dict[tuple[int, int], dist.ProcessGroup | None] = {}
    for tp, pp in spec.layouts or ((spec.tp_size, spec.pp_size),):
        tp_groups[(tp, pp)] = None
        for stage in range(pp):
            ranks = [stage * tp + t for t in range(tp)]
            group = dist.new_group(ranks, timeout=timeout) if tp > 1 else None
            if rank in ranks:
                tp_groups[(tp, pp)] = group
    logits = logits_groups(rank, spec, timeout)
    cpu_group = (dist.group.WORLD if spec.backend == "gloo"
                 else dist.new_group(backend="gloo", timeout=timeout))
    plan_group = dist.new_group(backend="gloo", timeout=IDLE_WAIT)
    symm = setup_symm_all_reduce(rank, spec, tp_groups, cpu_group)  # every layout's, at launch
    if rank == 0:
        log.info(symm.line)
    return Fabric(rank, spec, cpu_group, plan_group, tp_groups, symm, logits)



def warm_communicators(fabric: Fabric, device: torch.device, force: bool = False) -> list[str]:
    """Makes every communicator of every layout now, at launch: NCCL creates one on a group's
    first collective and on a pair's first point-to-point op, which would otherwise fall on a
    layout's first step after a seam (the other layout's TP groups, its stage-to-stage pairs,
    its logits pair). One element through each: every TP group, every pair of neighbouring
    stages (same TP rank), every logits pair, layout after layout in one global order that
    every rank walks. Each op involves only its ranks, and a rank meets its ops in that
    order, so the first unfinished op always has all its ranks at it: none can deadlock.
    Gloo connects its pairs when a group is made, so it has nothing to warm (`force`: do it
    anyway, for tests). Returns what this rank took part in."""
    spec = fabric.spec
    if spec.backend != "nccl" and not force:
        return []
    on = device if spec.backend == "nccl" else torch.device("cpu")
    x, done = torch.zeros(1, device=on), []
    rank = fabric.rank

    def pair(src: int, dst: int, group: dist.ProcessGroup | None, what: str) -> None:
        if rank == src:
            dist.send(x, dst, group=group)
        elif rank == dst:
            dist.recv(x, src, group=group)
        else:
            return
        done.append(f"{what} {src}->{dst}")

    for tp, pp in spec.layouts or ((spec.tp_size, spec.pp_size),):
        group = fabric.tp_groups.get((tp, pp))
        if tp > 1 and group is not None:
            dist.all_reduce(x, group=group)
            done.append(f"tp{tp}xpp{pp} tp group")
        for stage in range(pp - 1):
            for t in range(tp):
                pair(stage * tp + t, (stage + 1) * tp + t, None, f"tp{tp}xpp{pp} stages")
        last = (pp - 1) * tp
        if pp > 1 and last:
            pair(last, 0, fabric.logits.get((tp, pp)), f"tp{tp}xpp{pp} logits")
    if on.type == "cuda":
        torch.cuda.synchronize(on)
    return done

def logits_groups(rank: int, spec: DistSpec, timeout: datetime.timedelta
                  ) -> dict[tuple[int, int], dist.ProcessGroup | None]:
    """A group of two per PP layout, rank 0 and the last stage's TP rank 0 (layouts with the
    same pair share it), made at launch by every rank in the same order. The logits going
    back to rank 0 then have a communicator of their own: on the world group an NCCL pair
    runs its sends both ways on one stream, and the hidden states of the next decode group
    going out would wait for the logits of the last one coming back, which wait for them."""
    made: dict[int, dist.ProcessGroup] = {}
    out: dict[tuple[int, int], dist.ProcessGroup | None] = {}
    for tp, pp in spec.layouts or ((spec.tp_size, spec.pp_size),):
        if pp == 1:
            continue
        last = (pp - 1) * tp
        if last not in made:
            made[last] = dist.new_group([0, last], timeout=timeout)
        out[(tp, pp)] = made[last] if rank in (0, last) else None
    return out


def _await_ranks(store: dist.Store, spec: DistSpec,
                 peers_failed: Callable[[], list[str]]) -> None:
    """Until every rank set its join key. Another node has --dist-timeout-s to check in, as
    node k waits --dist-timeout-s for node 0; a node's ranks, once it checked in, and this
    node's have --dist-timeout-s but at least JOIN_FLOOR_S to join (a loaded host imports
    torch slowly)."""
    join_s = max(spec.timeout_s, JOIN_FLOOR_S)
    start = time.monotonic()
    said = False
    keys = [f"{JOIN_KEY}{r}" for r in range(spec.world_size)]
    check_ins = NodeCheckIns(store, spec.nnodes, spec.agreement, spec.init_addr)
    while not store.check(keys):
        check_ins.poll()
        if not said and spec.nnodes > 1 and time.monotonic() - start > 2:
            said = True  # an operator starting node k by hand wants to know who is awaited
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            absent = check_ins.absent()
            until = (f"nodes {absent} have up to {spec.timeout_s:g} s (--dist-timeout-s) to "
                     "check in" if absent else f"their ranks have up to {join_s:g} s to join")
            log.info("rank 0: waiting for ranks %s of %d nodes at %s (`phaseflip serve "
                     "--node-rank k` with the same flags): %s", missing, spec.nnodes,
                     spec.init_addr, until)
        why = _why_not_joined(peers_failed(), check_ins, spec, start, join_s)
        if why is not None:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise GroupFormationError(
                f"the rank group did not form: {why}; ranks not joined: {missing} "
                f"(world size {spec.world_size}, rendezvous {spec.init_addr})")
        time.sleep(0.1)


def _why_not_joined(failed: list[str], check_ins: NodeCheckIns, spec: DistSpec, start: float,
                    join_s: float) -> str | None:
    """Why rank 0 stops waiting now, or None to wait on."""
    now = time.monotonic()
    if failed:
        return f"{', '.join(failed)} exited while joining"
    absent = check_ins.absent()
    if absent and now - start > spec.timeout_s:
        nodes = ("node " if len(absent) == 1 else "nodes ") + ", ".join(map(str, absent))
        return (f"{nodes} did not check in within {spec.timeout_s:g} s "
                f"(--dist-timeout-s): start `phaseflip serve --node-rank k` with node 0's flags "
                f"and --dist-init-addr {spec.init_addr} on each, or give a larger "
                "--dist-timeout-s")
    if now - max([start, *check_ins.nodes.values()]) > join_s:
        return f"not every rank joined within {join_s:g} s (--dist-timeout-s, at least " \
               f"{JOIN_FLOOR_S:g} s)"
    return None


def rank_device(rank: int, spec: DistSpec, cfg: EngineConfig) -> torch.device:
    if cfg.device == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    local = rank - spec.node_rank * spec.ranks_per_node
    return torch.device("cuda", local % torch.cuda.device_count())
