"""A worker rank: joins the group once, then builds whatever layout rank 0 orders and executes
its plans verbatim, for the life of the server.

It holds no scheduling state: every decision arrives in the plan (law 1). A phase flip is a
`Relayout` message, not a new process: the rank drops its layout (weights, KV pool, graphs)
and builds the next one on the communicators it made at launch. A plan it cannot execute, or
a peer that never answers, stops the group with a named error (law 4).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from phaseflip.cache.hicache.frames import HostFrames, page_geometry
from phaseflip.cache.hicache.transfer import KVTransferEngine, rank_slice
from phaseflip.cache.kv_pool import KVArena
from phaseflip.config import EngineConfig
from phaseflip.distributed.group import (
    DistSpec,
    RankGroups,
    join,
    rank_device,
    warm_communicators,
)
from phaseflip.distributed.plan_channel import plan_channel
from phaseflip.distributed.plan_codec import PlanDecoder
from phaseflip.distributed.rendezvous import NODE0_GONE_EXIT, node0_gone
from phaseflip.distributed.reshard import PeerWeights, plan_between
from phaseflip.distributed.stage import StageExecutor, StepMessage
from phaseflip.distributed.watchdog import PositionTracker
from phaseflip.flip.weights import build_report, shard_bytes
from phaseflip.heap import freeze_heap, release_freed_heap
from phaseflip.model.config import ModelConfig
from phaseflip.model.cuda_graph import DecodeGraphs, GraphReuse
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.quant import Fp8Config, engine_quantization
from phaseflip.model.runner import ModelRunner, free_model, resolve_dtype
from phaseflip.model.weight_image import WeightImage
from phaseflip.threads import apply_cpu_threads

log = logging.getLogger("phaseflip.worker")

STOP = "stop"  # leave: the engine's end
RELEASE = "release"  # drop the layout you run (its weights, KV pool, graphs); keep the process
# the flip weights whose layouts' KV pools live in the rank's KV arena (`KVArena`). Not peer:
# its build holds the old shard (handed over) and the new one at once, so an arena reserved
# at launch would have to leave a whole shard of headroom free for the seam, taken from
# every layout's KV cache; peer pools are sized afresh from what is free instead.
KV_ARENA_WEIGHTS = ("resident", "host-image", "reload")


@dataclass
class Relayout:
    """Rank 0's order to every rank: drop the layout you run and build `cfg`'s (a phase flip,
    or the first layout after launch). The processes and communicators stay."""

    cfg: EngineConfig
    lazy_graphs: bool = False  # a seam's build: graphs captured on first use, not all now
    kv_arena: bool = False  # the pool lives in the rank's KV arena (`KV_ARENA_WEIGHTS`)


@dataclass
class RankLayout:
    """What one rank runs one layout with; replaced whole by the next layout."""

    groups: RankGroups
    runner: ModelRunner
    stage: StageExecutor
    # rank 0 only: every rank's build of this layout (`flip.weights.build_report`), so a
    # seam's census has each rank's bytes and free memory, not rank 0's alone
    rank_builds: list[dict[str, Any]] | None = None

    def release(self, keep_weights: bool = False,
                graphs_parked: bool = False) -> LlamaForCausalLM | None:
        """Frees this rank's graphs, KV pool and (unless `keep_weights`) weights in place
        (after its HiCache copies finished: they read the pool), so the next layout sizes its
        pool from what is free; a pool in the rank's KV arena lets go of its views only (the
        next pool views the same memory). `keep_weights`: returns the model, to be parked.
        `graphs_parked`: the rank keeps parked decode graphs (and what they address)."""
        if self.stage.transfers is not None:
            self.stage.transfers.close()
        self.runner.release_graphs()
        model = self.runner.free_device_memory(keep_weights, graphs_parked)
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()
        return model


class RankProcess:
    """One rank's process-lifetime state: its communicators for every layout (`Fabric`), its
    position tracker, the node's HiCache frames it maps, and the layout it runs now.

    Rank 0 (the driver) is handed the frames and the weight image it made; the other ranks map
    them by name, once: the image stays mapped and page-locked for the rank's life, since
    registering a 15 GiB mapping with CUDA takes seconds (it was the host-image seam's largest
    part while ranks mapped it per build)."""

    def __init__(self, rank: int, spec: DistSpec, run_dir: str | None, parent_pid: int | None,
                 frames: HostFrames | None = None, image: WeightImage | None = None,
                 peers_failed: Callable[[], list[str]] | None = None) -> None:
        self.rank, self.spec = rank, spec
        self.tracker = PositionTracker(rank, run_dir, parent_pid)
        with self.tracker.at("joining the process group"):
            self.fabric = join(rank, spec, peers_failed)
        self.frames, self._own_frames = frames, False
        self.image, self._own_image = image, False
        self._warm = False  # every layout's NCCL communicators made (at the first build)
        self.layout: RankLayout | None = None
        # resident weights: the shards of the layouts this rank does not run now, by (tp, pp)
        self.parked: dict[tuple[int, int], LlamaForCausalLM] = {}
        # ... and their decode graphs, when their KV pools live in the arena (kept as captured)
        self.parked_graphs: dict[tuple[int, int], DecodeGraphs] = {}
        # peer weights: the released layout's config and model, until the next build
        self.handover: tuple[EngineConfig, LlamaForCausalLM] | None = None
        self.peer_plans: dict[tuple, list] = {}  # its moves by (old layout, new layout)
        self.kv_arena = KVArena()  # every layout's KV pool, one allocation (KV_ARENA_WEIGHTS)
        self.tracker.set("idle")

    def kept_bytes(self) -> int:
        """Device bytes of the weights this rank keeps on purpose between layouts (the parked
        shards of resident weights, a handed-over model): what a teardown leaves allocated
        without anything having leaked."""
        models = [*self.parked.values(), *([self.handover[1]] if self.handover else [])]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for m in models for t in [*m.parameters(), *m.buffers()]}
        graphs = sum(g.device_bytes()[0] for g in self.parked_graphs.values())
        return sum(storages.values()) + self.kv_arena.nbytes + graphs

    def graphs_kept_bytes(self) -> int | None:
        """Device bytes the parked decode graphs hold (static buffers, private pools'
        reserved memory); None when none are parked or a pool is unreadable."""
        sizes = [g.device_bytes()[1] for g in self.parked_graphs.values()]
        return None if not sizes or None in sizes else sum(sizes)

    def relayout(self, cfg: EngineConfig, lazy_graphs: bool = False,
                 kv_arena: bool = False) -> RankLayout:
        """Drops the current layout, builds `cfg`'s (every rank at once: the KV slot space is
        agreed over the group). No rank builds before every rank has released: ranks that
        share a device would otherwise size their pools around each other's old layout.
        Its point-to-point sends still in flight end first (their peers are alive and have
        posted the receives): a gloo send's work owns its buffer."""
        if self.layout is not None:
            self.layout.stage.drain_sends()
        self.release()
        peer = self._take_handover(cfg)
        with self.tracker.at("waiting for every rank to release its layout"):
            dist.barrier(group=self.fabric.cpu_group)
        with self.tracker.at(f"building layout tp{cfg.tp_size}×pp{cfg.pp_size}"):
            self.layout = self._build(cfg, lazy_graphs, peer, kv_arena)
        parts = ", ".join(f"{k} {v:.3f} s" for k, v in self.layout.runner.build_s.items())
        log.info("rank %d built tp%d×pp%d: %s", self.rank, cfg.tp_size, cfg.pp_size, parts)
        report = build_report(self.rank, self.layout.runner)
        builds = [None] * dist.get_world_size(self.fabric.cpu_group) if self.rank == 0 else None
        with self.tracker.at("handing rank 0 this rank's build report"):
            dist.gather_object(report, builds, dst=0, group=self.fabric.cpu_group)
        self.layout.rank_builds = builds
        self.tracker.set("idle")
        return self.layout

    def _take_handover(self, cfg: EngineConfig) -> PeerWeights | None:
        """The peer strategy: the released layout's model, kept for the next build to take
        its slices from (and freed once it has)."""
        if self.handover is None:
            return None
        (old, model), self.handover = self.handover, None
        device = next(model.parameters()).device
        staged = self.spec.backend == "gloo" and device.type == "cuda"
        key = ((old.tp_size, old.pp_size), (cfg.tp_size, cfg.pp_size))
        if key not in self.peer_plans:  # the same every time for a pair of layouts
            self.peer_plans[key] = plan_between(ModelConfig.from_dir(cfg.model), *key,
                                                model.dtype, model.quant)
        return PeerWeights(self.rank, model, self.peer_plans[key], staged)

    def release(self, park: bool = True) -> None:
        """Drops the running layout; with resident weights (and `park`) its model stays on
        the device for the next build of that layout."""
        if self.layout is not None:
            layout, self.layout = self.layout, None
            cfg = layout.runner.cfg
            keep = park and cfg.flip_weights in ("resident", "peer")
            # a pool in the arena: the next build of this layout views the same addresses
            graphs = (layout.runner.park_graphs() if keep and cfg.flip_weights == "resident"
                      and layout.runner.pool.arena is not None else None)
            if graphs is not None:
                self.parked_graphs[(cfg.tp_size, cfg.pp_size)] = graphs
            with self.tracker.at("releasing the layout"):
                model = layout.release(keep, graphs_parked=bool(self.parked_graphs))
            if model is not None and cfg.flip_weights == "resident":
                self.parked[(cfg.tp_size, cfg.pp_size)] = model
            elif model is not None:  # peer: the next build takes its slices, then frees it
                self.handover = (cfg, model)
            if self.rank != 0:  # (rank 0's engine trims after the whole seam: EngineCore)
                release_freed_heap()
            device = layout.runner.device
            if device.type == "cuda":
                log.info("rank %d released its layout: %.2f GiB allocated, %.2f GiB reserved "
                         "on %s", self.rank, torch.cuda.memory_allocated(device) / 2**30,
                         torch.cuda.memory_reserved(device) / 2**30, device)
            self.tracker.set("idle")

    def close(self) -> None:
        self.release(park=False)
        recorded = any(g.record for g in self.parked_graphs.values())
        self.free_kept()
        if recorded and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
            torch.cuda.synchronize()  # the parked graphs' cuBLAS workspaces were kept
            torch._C._cuda_clearCublasWorkspaces()
        if self._own_frames and self.frames is not None:
            self.frames.close()
        if self._own_image and self.image is not None:
            self.image.close()
            self.image = None
        self.tracker.close()

    def free_kept(self) -> None:
        """Frees what this rank keeps between layouts (parked weights, a handed-over model,
        the KV arena) in place, with no device sync: also after a failed group, whose
        collectives may never complete. Parked graphs go first (before the communicators
        their collectives use)."""
        for graphs in self.parked_graphs.values():
            graphs.release()
        self.parked_graphs.clear()
        for model in self.parked.values():
            free_model(model)
        self.parked.clear()
        if self.handover is not None:
            free_model(self.handover[1])
            self.handover = None
        self.kv_arena.free()

    def _arena(self, cfg: EngineConfig, model_cfg: ModelConfig,
               device: torch.device) -> KVArena:
        """The rank's KV arena for a build; the launch build (nothing reserved yet) of weights
        that move at a seam first sets its headroom (`arena_headroom`), logged."""
        arena = self.kv_arena
        if not arena.nbytes and cfg.flip_weights != "resident":
            quant = engine_quantization(cfg, model_cfg.model_dir)
            arena.headroom = arena_headroom(
                self.rank, (cfg.tp_size, cfg.pp_size), self.spec.layouts, model_cfg,
                resolve_dtype(cfg.dtype, model_cfg, device), quant)
            log.info("rank %d: the KV arena leaves %.3f GiB free for its largest flip "
                     "layout's shard and a tensor's load", self.rank, arena.headroom / 2**30)
        return arena

    def _build(self, cfg: EngineConfig, lazy_graphs: bool,
               peer: PeerWeights | None = None, kv_arena: bool = False) -> RankLayout:
        groups = self.fabric.groups(cfg.tp_size, cfg.pp_size)
        model_cfg = ModelConfig.from_dir(cfg.model)
        misfit = model_cfg.layout_error(cfg.tp_size, cfg.pp_size)
        if misfit is not None:  # the driver refuses it first; a rank never builds it
            raise ValueError(misfit)
        tracker = self.tracker

        def agree(local_slots: int) -> int:
            return self._least(groups, local_slots, "agreeing on the KV slot space")

        def settle() -> None:  # every rank's new weights in, every old layout gone
            with tracker.at("waiting for every rank's weights before sizing the KV pool"):
                dist.barrier(group=groups.cpu_group)

        key = (cfg.tp_size, cfg.pp_size)
        reuse = self._graph_reuse(cfg, groups, lazy_graphs, kv_arena)
        device = self._prepare_device(cfg, groups)
        with tracker.at("loading weights, sizing the KV pool"):
            runner = ModelRunner(cfg, model_cfg, groups.layout(), device,
                                 agree_slots=agree, weights=self.image, before_sizing=settle,
                                 device_share=_device_share(self.spec, device),
                                 resident=self.parked.pop(key, None),
                                 lazy_graphs=lazy_graphs, weights_from=peer,
                                 kv_arena=self._arena(cfg, model_cfg, device) if kv_arena
                                 else None,
                                 graph_reuse=reuse)
        if self.rank == 0:  # the census's (it reads the allocator's snapshot)
            runner.graphs_kept_bytes = self.graphs_kept_bytes()
        transfers = self._hicache_transfers(cfg, model_cfg, runner, device)
        return RankLayout(groups, runner, StageExecutor(runner, groups, tracker, transfers))

    def _least(self, groups: RankGroups, value: int, what: str) -> int:
        """The minimum of `value` over every rank of the group."""
        t = torch.tensor([value], dtype=torch.int64)
        with self.tracker.at(what):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.cpu_group)
        return int(t.item())

    def _graph_reuse(self, cfg: EngineConfig, groups: RankGroups, lazy_graphs: bool,
                     kv_arena: bool) -> GraphReuse | None:
        """A seam's build of resident layouts: its parked graphs, if all agree (under the other
        flip weights the weights move)."""
        if not (kv_arena and lazy_graphs and cfg.flip_weights == "resident"):
            return None
        key = (cfg.tp_size, cfg.pp_size)
        return GraphReuse(self.parked_graphs.pop(key, None), lambda ok: bool(
            self._least(groups, int(ok), "agreeing on reusing the parked decode graphs")))

    def _prepare_device(self, cfg: EngineConfig, groups: RankGroups) -> torch.device:
        """Selects the rank's device; the launch build also makes every layout's communicators
        and maps the host weight image."""
        device = rank_device(self.rank, groups.spec, cfg)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if not self._warm:  # the launch layout's build: every layout's communicators now
            with self.tracker.at("making every layout's communicators"):
                warm_communicators(self.fabric, device)
            self._warm = True
        if self.spec.weight_image and self.image is None:
            with self.tracker.at("mapping the host weight image"):
                # page-locked only for a GPU rank (a CPU rank would make a CUDA context for it)
                self.image = WeightImage.open(self.spec.weight_image,
                                              register=device.type == "cuda")
                self._own_image = True
        return device

    def _hicache_transfers(self, cfg: EngineConfig, model_cfg: ModelConfig,
                           runner: ModelRunner, device: torch.device) -> KVTransferEngine | None:
        """The rank's HiCache transfer engine (opening the shared host frames once), if on."""
        if not self.spec.hicache_frames:
            return None
        geo = page_geometry(model_cfg.num_layers, model_cfg.num_kv_heads,
                            model_cfg.head_dim, runner.kv_dtype, cfg.hicache_page_size)
        if self.frames is None:
            self.frames = HostFrames.open_shared(self.spec.hicache_frames, geo.total_size)
            self._own_frames = True
        part = rank_slice(runner.layout, model_cfg.num_layers, model_cfg.num_kv_heads)
        return KVTransferEngine(runner.pool, self.frames, geo, part, device)


def arena_headroom(rank: int, launch: tuple[int, int], layouts: tuple[tuple[int, int], ...],
                   model_cfg: ModelConfig, dtype: torch.dtype, quant: Fp8Config | None) -> int:
    """The bytes `rank`'s shard of its largest layout takes beyond its launch layout's (0 if
    none is larger): a seam loads the next layout's weights with the KV arena still held, so
    the launch budget must leave them free (an uneven PP split puts more on some ranks)."""
    mine = [shard_bytes(model_cfg, tp, pp, dtype, quant)[rank] for tp, pp in {launch, *layouts}]
    larger = max(0, max(mine) - shard_bytes(model_cfg, *launch, dtype, quant)[rank])
    return larger + load_transient_bytes(model_cfg, dtype, quant, layouts)


def load_transient_bytes(model_cfg: ModelConfig, dtype: torch.dtype, quant: Fp8Config | None,
                         layouts: tuple[tuple[int, int], ...]) -> int:
    """The most a weight load holds on the device beyond the shard, one checkpoint tensor at a
    time: a row-parallel tensor uploaded whole before it is cut (under TP), or a projection
    quantized to FP8 on the device whole (its float copy, a float32 upcast, the scaled result
    and the FP8 output: ~13 bytes an element, counted for the block-FP8 dequantize too). A
    launch loads before its pool exists; a seam, with the arena held, needs this free."""
    m = model_cfg
    q = m.num_heads * m.head_dim
    largest = max(m.intermediate_size * m.hidden_size,
                  (q + 2 * m.num_kv_heads * m.head_dim) * m.hidden_size, q * m.hidden_size)
    if quant is not None:
        return 13 * largest
    tp = any(t > 1 for t, _ in layouts)
    return largest * torch.empty(0, dtype=dtype).element_size() if tp else 0


def allocator_for_flips(cfg: EngineConfig) -> None:
    """With flips on a GPU, the caching allocator maps memory in expandable segments: a
    released layout's free pages go back to the driver even where a small live tensor shares
    their segment. With whole segments, the KV pool of the next layout shrank flip after flip
    under load on the H200 (207 523 → 82 755 slots in two cycles, 2.6-5.1 GiB reserved and
    unallocated at sizing despite `empty_cache`). An operator's PYTORCH_CUDA_ALLOC_CONF that
    names the setting wins."""
    if not cfg.enable_flip or cfg.device == "cpu" or not torch.cuda.is_available():
        return
    if "expandable_segments" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    try:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    except (AttributeError, RuntimeError) as e:  # an allocator without the setting
        log.warning("expandable segments unavailable (%s): a flip's KV pool may come out "
                    "smaller than a fresh launch's", e)


def _device_share(spec: DistSpec, device: torch.device) -> int:
    """How many of this node's ranks share `device` (more than one only when there are fewer
    GPUs than ranks, e.g. correctness runs of several ranks on one GPU)."""
    if device.type != "cuda":
        return 1
    return max(1, -(-spec.ranks_per_node // torch.cuda.device_count()))


def worker_main(rank: int, spec: DistSpec, cfg: EngineConfig, run_dir: str | None,
                parent_pid: int) -> None:
    """A worker rank for the life of the server: join, then execute rank 0's messages —
    relayouts, plans, releases — until STOP."""
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s rank{rank} %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the engine watchdog's stack dump
    apply_cpu_threads(cfg)
    allocator_for_flips(cfg)
    try:
        proc = RankProcess(rank, spec, run_dir, parent_pid)
    except Exception as e:  # noqa: BLE001 — report, then exit (not multiprocessing's trace)
        _fail(spec, e, None)
    tracker = proc.tracker
    plans = PlanDecoder()
    if torch.cuda.is_available():  # the import heap out of the collector's full passes (the
        freeze_heap()  # first layout may be a throwaway warm-up: frozen, it would stay)
    channel = plan_channel(rank, spec.world_size, spec.ranks_per_node, proc.fabric.plan_group)
    try:
        while True:
            with tracker.at("waiting for the next message from rank 0"):
                msg = channel.recv()
            if msg == STOP:
                break
            if msg == RELEASE:
                proc.release()
            elif isinstance(msg, Relayout):
                proc.relayout(msg.cfg, msg.lazy_graphs, msg.kv_arena)
                plans = PlanDecoder()  # it mirrors one layout's slot space
            else:
                _run_step(proc, plans, msg)
            tracker.set("idle")
    except Exception as e:  # noqa: BLE001 — report with every rank's position, then exit
        _fail(spec, e, tracker)
    # every rank tears down at once: graphs before the communicator their all-reduces use
    proc.close()
    dist.destroy_process_group()


def _fail(spec: DistSpec, exc: Exception, tracker: PositionTracker | None) -> NoReturn:
    """Reports `exc` (with every rank's position once joined) and exits 1. A rank of node k
    whose node 0 went away exits NODE0_GONE_EXIT instead, without a report: its node's
    process says that in one line (`rendezvous.NodeLink.watch`)."""
    if spec.node_rank > 0 and node0_gone(spec.init_addr):
        os._exit(NODE0_GONE_EXIT)
    err = tracker.stall_error(exc, spec.world_size) if tracker is not None else exc
    log.error("%s\n%s", err, traceback.format_exc())
    os._exit(1)


def _run_step(proc: RankProcess, plans: PlanDecoder, msg: StepMessage) -> None:
    if proc.layout is None:
        raise RuntimeError(f"step {msg.step} arrived before any layout was built")
    if msg.plan is not None:
        with proc.tracker.at("rebuilding the plan from rank 0's slots", msg.step):
            msg.plan = plans.decode(msg.plan)
    proc.layout.stage.run(msg)
