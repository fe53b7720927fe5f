"""A worker rank: joins the group, loads its shard, then executes the driver's plans verbatim.

It holds no scheduling state: every decision arrives in the plan (law 1). A plan it cannot
execute, or a peer that never answers, stops the group with a named error (law 4).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from phaseflip.cache.hicache.frames import HostFrames, page_geometry
from phaseflip.cache.hicache.transfer import KVTransferEngine, rank_slice
from phaseflip.config import EngineConfig
from phaseflip.distributed.group import DistSpec, RankGroups, join, rank_device
from phaseflip.distributed.plan_codec import PlanDecoder
from phaseflip.distributed.stage import StageExecutor
from phaseflip.distributed.watchdog import PositionTracker
from phaseflip.model.config import ModelConfig
from phaseflip.model.runner import ModelRunner
from phaseflip.model.weight_image import WeightImage
from phaseflip.threads import apply_cpu_threads

log = logging.getLogger("phaseflip.worker")

STOP = "stop"


def build_rank(rank: int, spec: DistSpec, cfg: EngineConfig, run_dir: str | None,
               parent_pid: int | None, frames: HostFrames | None = None,
               image: WeightImage | None = None,
               peers_failed: Callable[[], list[str]] | None = None,
               ) -> tuple[RankGroups, ModelRunner, StageExecutor]:
    """Everything one rank needs; the driver calls it for rank 0 too (with the HiCache host
    frames and the host weight image it created; other ranks map them by name, the image
    only while they load their shard). `peers_failed`: rank 0's local workers that exited, so
    a group that cannot form fails at once (`join`)."""
    tracker = PositionTracker(rank, run_dir, parent_pid)
    with tracker.at("joining the process group"):
        groups = join(rank, spec, peers_failed)
    model_cfg = ModelConfig.from_dir(cfg.model)
    if spec.pp_size > model_cfg.num_layers:
        raise ValueError(f"pp_size={spec.pp_size} exceeds the model's {model_cfg.num_layers} "
                         "layers")

    def agree(local_slots: int) -> int:
        t = torch.tensor([local_slots], dtype=torch.int64)
        with tracker.at("agreeing on the KV slot space"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=groups.cpu_group)
        return int(t.item())

    device = rank_device(rank, spec, cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mapped = None
    if spec.weight_image and image is None:
        with tracker.at("mapping the host weight image"):
            # page-locked only for a GPU rank (a CPU rank would make a CUDA context for it)
            image = mapped = WeightImage.open(spec.weight_image,
                                              register=device.type == "cuda")
    try:
        with tracker.at("loading weights, sizing the KV pool"):
            runner = ModelRunner(cfg, model_cfg, groups.layout(), device, agree_slots=agree,
                                 weights=image)
    finally:
        if mapped is not None:
            mapped.close()  # the parameters are copies: the mapping is not needed after
    transfers = None
    if spec.hicache_frames:
        geo = page_geometry(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                            runner.dtype, cfg.hicache_page_size)
        frames = frames or HostFrames.open_shared(spec.hicache_frames, geo.total_size)
        part = rank_slice(runner.layout, model_cfg.num_layers, model_cfg.num_kv_heads)
        transfers = KVTransferEngine(runner.pool, frames, geo, part, device)
    tracker.set("idle")
    return groups, runner, StageExecutor(runner, groups, tracker, transfers)


def worker_main(rank: int, spec: DistSpec, cfg: EngineConfig, run_dir: str | None,
                parent_pid: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the engine watchdog's stack dump
    apply_cpu_threads(cfg)
    groups, runner, stage = build_rank(rank, spec, cfg, run_dir, parent_pid)
    tracker = stage.tracker
    plans = PlanDecoder()
    try:
        while True:
            box = [None]
            with tracker.at("waiting for the next plan from rank 0"):
                dist.broadcast_object_list(box, src=0, group=groups.plan_group)
            msg = box[0]
            if msg == STOP:
                break
            if msg.plan is not None:
                with tracker.at("rebuilding the plan from rank 0's slots", msg.step):
                    msg.plan = plans.decode(msg.plan)
            stage.run(msg)
            tracker.set("idle")
    except Exception as e:  # noqa: BLE001 — report with every rank's position, then exit
        err = tracker.stall_error(e, spec.world_size)
        log.error("%s\n%s", err, traceback.format_exc())
        os._exit(1)
    finally:
        tracker.close()
    runner.release_graphs()  # before the communicator its captured all-reduces use
    dist.destroy_process_group()
