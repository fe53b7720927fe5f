"""The driver's side of a multi-rank layout: spawn the local worker ranks, then for every step
broadcast the forward plan, run stage 0 / TP rank 0 itself and collect the logits.

`DistributedRunner` stands in for `ModelRunner` inside `EngineCore`, so the scheduler (the one
decider) does not know how many ranks execute its plans. With HiCache it is handed the node's
shared host frames (made and freed by the HiCache controller, which outlives this runner across
phase flips), has every local rank map them, and carries the controller's transfer orders to
every rank (`DistributedChannel`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.transfer import TransferChannel, TransferOrders
from phaseflip.config import EngineConfig
from phaseflip.distributed.group import DistSpec
from phaseflip.distributed.plan_codec import PlanEncoder
from phaseflip.distributed.stage import StepMessage
from phaseflip.distributed.worker import STOP, build_rank, worker_main
from phaseflip.forward_batch import ForwardBatch
from phaseflip.model.weight_image import WeightImage

log = logging.getLogger(__name__)


class DistributedChannel(TransferChannel):
    """HiCache transfer orders ride the next message rank 0 broadcasts (a plan, or a fence when
    nothing runs); a ticket is that message's number.

    Why completion is known without any extra message: every rank executes a message's orders
    before its forward and orders that forward after the copies of all EARLIER messages
    (`StageExecutor.run`). The logits of step m reach the driver only after every rank ran its
    part of forward m: TP ranks all-reduce in every layer, stage s+1 needs stage s's hidden
    states, and the logits come from the last stage. So when forward m has returned, the copies
    of every message < m are done on every rank; a fence (all ranks synchronise their copies,
    then meet in a barrier) completes its own message too. Loads of message t are *visible* as
    soon as t is sent: any later forward is ordered after them on every rank.
    """

    def __init__(self, runner: DistributedRunner) -> None:
        self.runner = runner
        self._staged = TransferOrders()
        self.completed = 0  # every message <= this is done on every rank
        self.before_shutdown: list[Callable[[], None]] = []

    def dispatch(self, orders: TransferOrders) -> object:
        self._staged.extend(orders)
        return self.runner.step_no + 1

    def take(self) -> TransferOrders | None:
        orders, self._staged = self._staged, TransferOrders()
        return orders or None

    def visible(self, ticket: object) -> bool:
        return ticket <= self.runner.step_no  # type: ignore[operator]

    def done(self, ticket: object) -> bool:
        return ticket <= self.completed  # type: ignore[operator]

    def fence(self) -> None:
        self.runner.fence()

    def shutdown(self) -> None:
        callbacks, self.before_shutdown = self.before_shutdown, []
        for cb in callbacks:
            cb()


class DistributedRunner:
    def __init__(self, cfg: EngineConfig, hicache_frames: HostFrames | None = None,
                 weight_image: WeightImage | None = None) -> None:
        """`hicache_frames`: HiCache's host tier as shared memory of the node (None: no
        HiCache). Its owner is the controller: this runner never frees it. `weight_image`:
        the checkpoint in shared memory of the node, which every rank loads its shard from
        instead of the checkpoint (None: from the checkpoint); its owner is the engine."""
        if dist.is_initialized():  # left by an earlier group of this process that was stopped
            with contextlib.suppress(Exception):  # without teardown (a stall): it is dead
                self._destroy_group(timeout_s=30)
        self.spec = DistSpec.from_config(cfg)
        self.step_no = 0
        # each row's new slots only, to ranks that mirror the rest (checked when accounting is)
        self.encoder = PlanEncoder(check=cfg.check_accounting)
        self.hicache_frames = hicache_frames
        self.hicache_channel = None
        if hicache_frames is not None:
            if hicache_frames.path is None:
                raise ValueError("the ranks of a TP/PP group need shared HiCache host frames")
            # every local rank maps the frames by name (`DistSpec.hicache_frames`)
            self.spec = dataclasses.replace(self.spec, hicache_frames=str(hicache_frames.path))
            self.hicache_channel = DistributedChannel(self)
        self.weight_image = weight_image
        if weight_image is not None:  # every local rank maps it by name while it loads
            self.spec = dataclasses.replace(self.spec, weight_image=str(weight_image.path))
        self._start(cfg)
        self.closed = False

    def _start(self, cfg: EngineConfig) -> None:
        self.run_dir = tempfile.mkdtemp(prefix="phaseflip-ranks-")
        spawn = mp.get_context("spawn")
        self.workers = [
            spawn.Process(target=worker_main, name=f"phaseflip-rank{r}", daemon=True,
                          args=(r, self.spec, cfg, self.run_dir, os.getpid()))
            for r in self.spec.local_ranks() if r != 0
        ]
        for w in self.workers:
            w.start()
        try:
            self.groups, self.runner, self.stage = build_rank(
                0, self.spec, cfg, self.run_dir, None, self.hicache_frames, self.weight_image,
                peers_failed=self._exited_workers)
        except BaseException:
            for w in self.workers:  # none of them may outlive a group that did not form
                w.terminate()
            for w in self.workers:
                w.join(timeout=5)
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise

    def _exited_workers(self) -> list[str]:
        return [f"{w.name} (exit code {w.exitcode})" for w in self.workers
                if w.exitcode is not None]

    # the `Runner` protocol (model/runner.py), as rank 0 sees it
    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    @property
    def weights_load(self):
        """Rank 0's `WeightsLoad` (how it loaded its shard, timed)."""
        return self.runner.weights_load

    @property
    def graphs(self):
        """Rank 0's decode graphs (each rank captures its own)."""
        return self.runner.graphs

    def transfer_channel(self, frames: HostFrames, geometry: object) -> DistributedChannel:
        """HiCache's channel to every rank: orders ride the plan broadcast (`Runner`)."""
        if self.hicache_channel is None or frames is not self.hicache_frames:
            raise RuntimeError("HiCache: the ranks map other host frames than the controller's")
        return self.hicache_channel

    def forward(self, plan: ForwardBatch, future: torch.Tensor | None = None) -> torch.Tensor:
        """The `Runner` forward; `future` (an overlapped step's tokens) is one process's only."""
        if future is not None:
            raise ValueError("overlapped steps (future tokens) run in one process only")
        logits = self._send(plan, fence=False)
        if self.hicache_channel is not None:
            self.hicache_channel.completed = self.step_no - 1
        return logits.to(self.runner.device)

    def fence(self) -> None:
        """Deliver pending HiCache orders and wait until every rank has done all its copies."""
        self._send(None, fence=True)
        if self.hicache_channel is not None:
            self.hicache_channel.completed = self.step_no

    def _send(self, plan: ForwardBatch | None, fence: bool) -> torch.Tensor | None:
        self.step_no += 1
        tracker = self.stage.tracker
        channel = self.hicache_channel
        msg = StepMessage(self.step_no, plan, channel.take() if channel else None, fence)
        wire = dataclasses.replace(msg, plan=self.encoder.encode(plan)) if plan else msg
        try:
            with tracker.at("broadcasting the plan", self.step_no):
                dist.broadcast_object_list([wire], src=0, group=self.groups.plan_group)
            return self.stage.run(msg)
        except Exception as e:
            dead = [w.name for w in self.workers if not w.is_alive()]
            err = tracker.stall_error(e, self.spec.world_size)
            if dead:
                err = type(err)(f"{err}\n  dead ranks: {', '.join(dead)}")
            self.close(graceful=False)
            raise err from e
        finally:
            tracker.set("idle")

    def report_ranks(self) -> list[str]:
        """Every rank's last position; each live local worker also writes its stacks to its
        log (SIGUSR1, `worker_main`). Safe from another thread (the engine's watchdog)."""
        for w in self.workers:
            if w.pid is not None and w.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGUSR1)
        return self.stage.tracker.positions(self.spec.world_size)

    def check_alive(self) -> None:
        dead = [f"{w.name} (exit code {w.exitcode})" for w in self.workers if not w.is_alive()]
        if dead:
            self.close(graceful=False)
            raise RuntimeError(f"worker ranks died: {', '.join(dead)}; the group is stopped")

    def close(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful:
            try:
                dist.broadcast_object_list([STOP], src=0, group=self.groups.plan_group)
            except Exception:  # noqa: BLE001 — a dead peer; terminate below
                graceful = False
        if graceful:  # every rank tears down at once: NCCL's teardown may wait for its peers
            self.runner.release_graphs()
            self._destroy_group(timeout_s=30)
        # (after a dead peer the graphs stay: a device sync could wait on a collective that
        # never completes; a later group's teardown of this one is bounded instead)
        if graceful:
            for w in self.workers:
                w.join(timeout=10)
        for w in self.workers:  # all at once: a failed group goes in one stroke, not 5 s each
            if w.is_alive():
                w.terminate()
        for w in self.workers:
            w.join(timeout=5)
        self.stage.tracker.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self.hicache_channel is not None:
            if self.stage.transfers is not None:  # rank 0's copies finish before the frames go
                self.stage.transfers.close()
            # the controller still bound (the engine's end, not a flip) flushes what is local
            # and frees the host tier
            with contextlib.suppress(Exception):
                self.hicache_channel.shutdown()
        if graceful:
            # in place, last (the copies above read the pool): a stray reference to this
            # runner must not keep rank 0's weights and KV pool from the next layout, whose
            # ranks size their pools from what is free (seen on the H200 pair after tp2 → pp2:
            # "-8.10 GiB left for the KV cache")
            self.runner.free_device_memory()

    @staticmethod
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
    """`phaseflip serve --node-rank k` (k > 0): run this host's ranks until the driver stops
    them. Returns non-zero if any rank failed."""
    spec = DistSpec.from_config(cfg)
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=worker_main, name=f"phaseflip-rank{r}",
                           args=(r, spec, cfg, None, os.getpid()))
             for r in spec.local_ranks()]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)
