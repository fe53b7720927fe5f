"""One object per layout: what the engine runs a TP × PP layout with, built whole, swapped whole.

A `LayoutBundle` holds everything that belongs to one layout and dies with it: the config it
was built for, the runner (this process's rank, or the driver of a rank group) with its KV pool
and decode graphs, the KV manager over that pool (slot allocator, request table, radix tree),
and the HiCache binding (the controller bound to this KV manager, through the transfer channel
the runner opened over the host tier). What outlives layouts is outside it: the scheduler's
queues, the HiCache controller with its host and disk tiers, the host weight image.

It is frozen: nothing outside assigns its fields. `build_layout_bundle` is the one factory;
`retire` (a phase flip) and `close` (the engine's end) are the two ways out. A flip swaps the
engine's bundle for a new one; it never edits one.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

from phaseflip.cache.hicache.transfer import TransferChannel
from phaseflip.cache.kv_pool import kv_cache_dtype
from phaseflip.config import EngineConfig
from phaseflip.model.config import ModelConfig
from phaseflip.model.runner import ModelRunner, Runner
from phaseflip.scheduler.kv_cache import KVCacheManager

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayoutBundle:
    cfg: EngineConfig  # the layout's config (its tp_size × pp_size)
    runner: Runner  # the ranks; their KV pools and decode graphs
    kv: KVCacheManager  # the slot space of the runner's pools, its request table and tree
    hicache: Any = None  # the HiCache controller bound to `kv` (None: no host tier)
    channel: TransferChannel | None = None  # HiCache's copies to the ranks' pools

    @property
    def layout(self) -> tuple[int, int]:
        return self.cfg.tp_size, self.cfg.pp_size

    @property
    def graphs(self) -> object | None:
        """The decode graph set (rank 0's; None when decode runs eagerly)."""
        return self.runner.graphs

    def retire(self) -> int | None:
        """Ends this layout for the next one (a phase flip, after the tree was dropped):
        unbinds the HiCache controller, which stays open with its host tier, then releases
        the layout on the ranks (their device memory is freed; the processes stay). Returns
        the device bytes this process still has allocated afterwards (None off CUDA)."""
        if self.hicache is not None:
            self.hicache.unbind()
        # no garbage collection here: the ranks free their storage in place, and a full
        # collection costs ~0.14 s of the seam (measured on the CPU box)
        return self._stop_ranks(collect=False)

    def close(self) -> int | None:
        """The engine's end: stops the ranks and frees their device memory (the HiCache
        controller is closed by its owner, the engine, afterwards)."""
        return self._stop_ranks(collect=True)

    def _stop_ranks(self, collect: bool) -> int | None:
        device = self.runner.device
        self.runner.close()
        if device.type != "cuda":
            return None  # the full pass below is for the device memory figure only
        if collect:
            gc.collect()
        torch.cuda.empty_cache()  # cached blocks go back to the driver
        return torch.cuda.memory_allocated(device)


def build_layout_bundle(cfg: EngineConfig, model_cfg: ModelConfig, max_context: int,
                        hicache: Any = None, weight_image: Any = None,
                        decode_reserve: Any = None, ranks: Any = None) -> LayoutBundle:
    """The one factory: the runner for `cfg` (its ranks map HiCache's host tier and load
    from `weight_image` when given), the KV manager over its slot space, and `hicache` bound
    to both. `decode_reserve`: the scheduler's, which the controller asks before a load.
    `ranks`: the engine's rank processes (a `RankSet`, several ranks), which build this
    layout in place; retiring the bundle releases the layout on them, the processes stay."""
    runner = _make_runner(cfg, model_cfg, hicache, weight_image, ranks)
    try:
        kv = KVCacheManager(runner.num_slots, cfg.page_size, cfg.max_running_requests + 1,
                            max_context + 1, cfg.enable_prefix_cache)
        channel = None
        if hicache is not None:
            channel = runner.transfer_channel(hicache.host.frames, hicache.geometry)
            hicache.bind(kv, channel, kv_cache_dtype(cfg.kv_cache_dtype, runner.dtype))
            hicache.decode_reserve = decode_reserve
    except BaseException:
        runner.close()
        raise
    return LayoutBundle(cfg, runner, kv, hicache, channel)


def _make_runner(cfg: EngineConfig, model_cfg: ModelConfig, hicache: Any,
                 weight_image: Any, ranks: Any) -> Runner:
    if cfg.world_size > 1:
        from phaseflip.distributed.driver import DistributedRunner

        return DistributedRunner(cfg, hicache.host.frames if hicache else None, weight_image,
                                 ranks)
    return ModelRunner(cfg, model_cfg)
