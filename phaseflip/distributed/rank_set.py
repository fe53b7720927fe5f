"""The node's rank processes, for the life of the engine: spawned and joined once, with the
communicators of every layout they may run; a phase flip re-lays them out, it never restarts
them.

Rank 0 is this process (the driver); ranks 1.. are spawned workers (`worker_main`) that
execute what rank 0 broadcasts on the plan group: `Relayout` (build a layout), step messages
(plans, HiCache orders), `RELEASE` (drop the layout) and `STOP`. `DistributedRunner` runs one
layout on a `RankSet`; the engine holds the set across its layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import threading

import torch.distributed as dist

from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.config import EngineConfig
from phaseflip.distributed.group import DistSpec, check_layouts
from phaseflip.distributed.plan_channel import plan_channel
from phaseflip.distributed.rendezvous import NodeJoinError, NodeLink, RemoteNodes, end_process
from phaseflip.distributed.spawner import start_rank
from phaseflip.distributed.worker import (
    KV_ARENA_WEIGHTS,
    RELEASE,
    STOP,
    RankLayout,
    RankProcess,
    Relayout,
    allocator_for_flips,
    worker_main,
)
from phaseflip.model.config import ModelConfig
from phaseflip.model.weight_image import WeightImage

log = logging.getLogger(__name__)
WARM_UP_KV_TOKENS = 8192  # the KV pool of a layout built only to warm its kernels up


class RankSet:
    def __init__(self, cfg: EngineConfig, hicache_frames: HostFrames | None = None,
                 weight_image: WeightImage | None = None) -> None:
        """Spawns this node's worker ranks and joins them. `hicache_frames` / `weight_image`:
        the node's shared HiCache host tier and checkpoint image (owned by the controller and
        the engine), which every rank maps by name."""
        if dist.is_initialized():  # left by an earlier group of this process that was stopped
            with contextlib.suppress(Exception):  # without teardown (a stall): it is dead
                _destroy_group(timeout_s=30)
        spec = DistSpec.from_config(cfg, ModelConfig.from_dir(cfg.model))
        if hicache_frames is not None:
            if hicache_frames.path is None:
                raise ValueError("the ranks of a TP/PP group need shared HiCache host frames")
            spec = dataclasses.replace(spec, hicache_frames=str(hicache_frames.path))
        if weight_image is not None:
            spec = dataclasses.replace(spec, weight_image=str(weight_image.path))
        self.spec, self.hicache_frames = spec, hicache_frames
        self.closed = False
        self.serving = False  # set once the launch layout is built
        self.remote: RemoteNodes | None = None  # the other nodes' beats, once the group formed
        self.run_dir = tempfile.mkdtemp(prefix="phaseflip-ranks-")
        self.workers = [
            start_rank(worker_main, (r, spec, cfg, self.run_dir, os.getpid()),
                       name=f"phaseflip-rank{r}", daemon=True)
            for r in spec.local_ranks() if r != 0
        ]
        allocator_for_flips(cfg)
        try:
            self.rank0 = RankProcess(0, spec, self.run_dir, None, hicache_frames, weight_image,
                                     peers_failed=self.exited_workers)
            self.plans = plan_channel(0, spec.world_size, spec.ranks_per_node, self.plan_group)
            # the other nodes' beats: a node that dies while the server idles is noticed
            self.remote = RemoteNodes(spec.init_addr, spec.nnodes) if spec.nnodes > 1 else None
        except BaseException:
            self._terminate()  # none of them may outlive a group that did not form
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    @property
    def tracker(self):
        return self.rank0.tracker

    @property
    def plan_group(self) -> dist.ProcessGroup:
        return self.rank0.fabric.plan_group

    def broadcast(self, msg: object) -> None:
        """One message to every rank (they wait for it without a deadline)."""
        self.plans.send(msg)  # shared memory on one node (distributed/plan_channel.py)

    def relayout(self, cfg: EngineConfig) -> RankLayout:
        """Every rank drops its layout and builds `cfg`'s; returns rank 0's. Once the ranks
        serve (the launch layout is built), a relayout is a seam's: its decode graphs are
        captured on first use rather than all before the cutover. With flips whose weights
        are resident, host-image or reload (`KV_ARENA_WEIGHTS`; not peer) the pools live in
        each rank's KV arena (`KVArena`): the launch layout's fills it, less the headroom a
        larger shard of another layout needs on that rank."""
        arena = cfg.enable_flip and cfg.flip_weights in KV_ARENA_WEIGHTS
        layout = self._relayout(cfg, lazy_graphs=self.serving, kv_arena=arena)
        self.serving = True
        return layout

    def _relayout(self, cfg: EngineConfig, lazy_graphs: bool,
                  kv_arena: bool = False) -> RankLayout:
        msg = Relayout(cfg, lazy_graphs, kv_arena)
        self._guarded(lambda: self.broadcast(msg), "ordering a relayout")
        return self._guarded(lambda: self.rank0.relayout(cfg, lazy_graphs, kv_arena),
                             "building the layout")

    def warm_up(self, cfg: EngineConfig) -> None:
        """Builds every other layout the ranks may flip to once, then releases it: the kernels
        those layouts' shapes need are compiled and their graph capture code paths run at
        launch, not on a seam (on the H200, 8B: the first pp2 capture took 7.06 s, later ones
        0.3-0.5 s)."""
        launch = (cfg.tp_size, cfg.pp_size)
        for tp, pp in self.spec.layouts:
            if (tp, pp) != launch:
                # a small KV pool: the kernels and graphs are the same, the launch layout's
                # pool is sized after it (on the H200 a warmed 8B layout's freed pool once
                # stayed reserved by its rank, and the launch pool got 57 % of its budget)
                layout = self._relayout(dataclasses.replace(
                    cfg.with_layout(tp, pp), max_total_tokens=WARM_UP_KV_TOKENS),
                    lazy_graphs=False)
                log.info("warmed up layout tp%d×pp%d at launch (rank 0: %s)", tp, pp,
                         ", ".join(f"{k} {v:.2f} s" for k, v in layout.runner.build_s.items()))
                self.release()

    def kept_bytes(self) -> int:
        """Rank 0's weights kept on purpose between layouts (`RankProcess.kept_bytes`)."""
        return self.rank0.kept_bytes()

    def release(self) -> None:
        """Every rank drops its layout (weights, KV pool, graphs), so the next one sizes its
        pool from what is free; the processes stay."""
        self._guarded(lambda: self.broadcast(RELEASE), "ordering a release")
        self.rank0.release()

    def _guarded(self, fn, what: str):
        try:
            with self.tracker.at(what):
                return fn()
        except Exception as e:
            err = self.stall_error(e)
            self.close(graceful=False)
            raise err from e
        finally:
            self.tracker.set("idle")

    def stall_error(self, exc: BaseException):
        err = self.tracker.stall_error(exc, self.spec.world_size)
        dead = [w.name for w in self.workers if not w.is_alive()]
        return type(err)(f"{err}\n  dead ranks: {', '.join(dead)}") if dead else err

    def exited_workers(self) -> list[str]:
        """This node's workers that exited, then each other node whose ranks exited or whose
        `serve --node-rank k` stopped beating (`rendezvous.RemoteNodes`)."""
        local = [f"{w.name} (exit code {w.exitcode})" for w in self.workers
                 if w.exitcode is not None]
        return local + (self.remote.failed() if self.remote is not None else [])

    def report_ranks(self) -> list[str]:
        """Every rank's last position; each live local worker also writes its stacks to its
        log (SIGUSR1, `worker_main`). Safe from another thread (the engine's watchdog)."""
        for w in self.workers:
            if w.pid is not None and w.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGUSR1)
        return self.tracker.positions(self.spec.world_size)

    def check_alive(self) -> None:
        dead = self.exited_workers()
        if dead:
            self.close(graceful=False)
            raise RuntimeError(f"worker ranks died: {', '.join(dead)}; the group is stopped")

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None]

    def close(self, graceful: bool = True) -> None:
        """STOP every rank and tear the group down (graceful), or terminate the workers (a
        failed group: a device sync could wait on a collective that never completes)."""
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                self.broadcast(STOP)
            except Exception:  # noqa: BLE001 — a dead peer; terminate below
                graceful = False
        if graceful:  # every rank tears down at once: NCCL's teardown may wait for its peers
            self.rank0.close()
            _destroy_group(timeout_s=30)
            for w in self.workers:
                w.join(timeout=10)
        else:  # rank 0 lives in this process: what it keeps across layouts goes now
            self.rank0.free_kept()
        self._terminate()
        self.plans.close()
        self.tracker.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _terminate(self) -> None:
        for w in self.workers:  # all at once: a failed group goes in one stroke, not 5 s each
            if w.is_alive():
                w.terminate()
        for w in self.workers:
            w.join(timeout=5)


def _destroy_group(timeout_s: float) -> None:
    """destroy_process_group, given up on after `timeout_s` (a peer that never arrives must
    not hang the shutdown; the workers are terminated after it)."""
    if not dist.is_initialized():
        return
    done = threading.Thread(target=dist.destroy_process_group, daemon=True,
                            name="phaseflip-destroy-group")
    done.start()
    done.join(timeout_s)
    if done.is_alive():
        log.warning("process group teardown did not finish in %.0f s; going on", timeout_s)


def run_node_workers(cfg: EngineConfig) -> int:
    """`phaseflip serve --node-rank k` (k > 0): wait for node 0, check this node's flags in
    with it, then run this host's ranks until the driver stops them, beating to rank 0 all
    the while (`rendezvous.NodeLink`). Returns 1, its last log line saying why, if node 0
    never came, refused this node, went away or stopped answering before the ranks ended,
    or any rank failed."""
    model_cfg = ModelConfig.from_dir(cfg.model)
    check_layouts(cfg, model_cfg)  # at once, not after the driver's deadline
    spec = DistSpec.from_config(cfg, model_cfg)
    try:
        link = NodeLink.open(spec.init_addr, spec.node_rank, spec.agreement, spec.timeout_s)
    except NodeJoinError as e:
        log.error("phaseflip exits with code 1: %s", e)
        end_process(1)  # (a check-in that got no answer may have left a thread in the store)
        return 1
    procs = [start_rank(worker_main, (r, spec, cfg, None, os.getpid()),
                        name=f"phaseflip-rank{r}")
             for r in spec.local_ranks()]
    code = link.watch(procs)
    if code:
        log.error("phaseflip exits with code 1: %s", link.failure)
    end_process(code)  # (a frozen node 0 holds the beat thread in a store call)
    return code
