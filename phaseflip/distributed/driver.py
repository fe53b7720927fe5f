"""The driver's side of a multi-rank layout: spawn the local worker ranks, then for every step
broadcast the forward plan, run stage 0 / TP rank 0 itself and collect the logits.

`DistributedRunner` stands in for `ModelRunner` inside `EngineCore`, so the scheduler (the one
decider) does not know how many ranks execute its plans.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from phaseflip.config import EngineConfig
from phaseflip.distributed.group import DistSpec
from phaseflip.distributed.worker import STOP, build_rank, worker_main
from phaseflip.forward_batch import ForwardBatch


class DistributedRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.spec = DistSpec.from_config(cfg)
        self.run_dir = tempfile.mkdtemp(prefix="phaseflip-ranks-")
        spawn = mp.get_context("spawn")
        self.workers = [
            spawn.Process(target=worker_main, name=f"phaseflip-rank{r}", daemon=True,
                          args=(r, self.spec, cfg, self.run_dir, os.getpid()))
            for r in self.spec.local_ranks() if r != 0
        ]
        for w in self.workers:
            w.start()
        self.groups, self.runner, self.stage = build_rank(0, self.spec, cfg, self.run_dir, None)
        self.step_no = 0
        self.closed = False

    # the ModelRunner surface EngineCore uses
    @property
    def num_slots(self) -> int:
        return self.runner.num_slots

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def forward(self, plan: ForwardBatch) -> torch.Tensor:
        self.step_no += 1
        tracker = self.stage.tracker
        try:
            with tracker.at("broadcasting the plan", self.step_no):
                dist.broadcast_object_list([(self.step_no, plan)], src=0,
                                           group=self.groups.cpu_group)
            logits = self.stage.execute(self.step_no, plan)
        except Exception as e:
            dead = [w.name for w in self.workers if not w.is_alive()]
            err = tracker.stall_error(e, self.spec.world_size)
            if dead:
                err = type(err)(f"{err}\n  dead ranks: {', '.join(dead)}")
            self.close(graceful=False)
            raise err from e
        finally:
            tracker.set("idle")
        return logits.to(self.runner.device)

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
                dist.broadcast_object_list([STOP], src=0, group=self.groups.cpu_group)
            except Exception:  # noqa: BLE001 — a dead peer; terminate below
                graceful = False
        for w in self.workers:
            w.join(timeout=10 if graceful else 0.1)
            if w.is_alive():
                w.terminate()
                w.join(timeout=5)
        self.stage.tracker.close()
        if graceful and dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.run_dir, ignore_errors=True)


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
