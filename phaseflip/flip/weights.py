"""Weight strategies of a flip (docs/design.md): how the new layout's ranks get their weights, and
the planner that picks one at launch.

- `resident` (dual-resident): every layout the ranks may run keeps its shards on the device;
  a flip releases only the old layout's KV pool and graphs and builds the new layout on the
  weights it parked at launch. No bytes move at the seam; the price is device memory, taken
  from the KV budget of every layout alike (so a flip's pool equals a fresh launch's).
- `peer` (device-to-device): every rank keeps the checkpoint slices it already holds and
  receives the rest from the ranks that hold them, at the seam, after the old KV pool is
  gone (`distributed/reshard.py`); over NCCL between GPUs, through the host on gloo.
- `host-image`: the checkpoint in a shared, page-locked host image, checksummed per tensor
  (`model/weight_image.py`); the new ranks copy their shards from it.
- `reload`: as at launch, from the checkpoint (or re-initialised dummy weights).

`--flip-weights auto` asks `plan_weights`: resident when the parked shards cost at most
`RESIDENT_MAX_SHARE` of a rank's memory budget; else peer when every rank has its own GPU
(NCCL); else the host image for
a real checkpoint; else reload. The planner weighs memory and the link kind, not measured
link rates. Whatever the strategy, rank 0's `WeightsLoad` is what the
census reports (None where unmeasured, law 5).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from phaseflip.config import EngineConfig
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import meta_shards
from phaseflip.model.quant import Fp8Config, engine_quantization
from phaseflip.model.weight_image import param_bytes

log = logging.getLogger("phaseflip.engine.flip")

STRATEGIES = ("resident", "peer", "host-image", "reload")
# resident when the other layouts' shards take at most this share of a rank's memory budget:
# beyond it the KV pool (the cache every layout serves from) pays more than a seam's copy
RESIDENT_MAX_SHARE = 0.25


@dataclass(frozen=True)
class WeightsPlan:
    """The strategy chosen at launch and why; the bytes are per rank, the worst rank's."""

    strategy: str
    parked_bytes: int  # the other layouts' shards a rank keeps on its device (resident)
    budget_bytes: int | None  # a rank's memory budget the planner compared them with
    reason: str

    def line(self) -> str:
        return f"flip weights: {self.strategy} ({self.reason})"


def shard_bytes(model_cfg: ModelConfig, tp_size: int, pp_size: int, dtype: torch.dtype,
                quant: Fp8Config | None = None) -> list[int]:
    """Weight bytes of every rank's shard of a tp × pp layout (rank order: tp fastest),
    counted on the meta device: exactly what the layout allocates (FP8 projections at one
    byte, an FP8 LM head's copy beside its weight), nothing read."""
    return [param_bytes(m) + (m.lm_head.derived_bytes if m.layout.is_last_stage else 0)
            for m in meta_shards(model_cfg, tp_size, pp_size, dtype, quant)]


def parked_bytes(model_cfg: ModelConfig, layouts: tuple[tuple[int, int], ...],
                 dtype: torch.dtype, quant: Fp8Config | None = None) -> int:
    """The worst rank's bytes of the layouts it keeps parked beside the one it runs (the
    smallest running shard is counted as running)."""
    per_rank = [shard_bytes(model_cfg, tp, pp, dtype, quant) for tp, pp in layouts]
    totals = [sum(col) - min(col) for col in zip(*per_rank, strict=True)]
    return max(totals) if totals else 0


def rank_budget(cfg: EngineConfig, device: torch.device) -> int | None:
    """A rank's memory for weights and KV: its share of `mem_fraction` of the GPU (ranks
    sharing a GPU split it), or of the host's RAM on CPU. None if unknown."""
    per_node = cfg.world_size // cfg.nnodes
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        share = max(1, -(-per_node // torch.cuda.device_count()))
        return int(total * cfg.mem_fraction / share)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None
    return int(ram * cfg.mem_fraction / per_node)


def plan_weights(cfg: EngineConfig, model_cfg: ModelConfig, layouts: tuple, dtype: torch.dtype,
                 budget: int | None, backend: str = "gloo") -> WeightsPlan:
    """The weights strategy of this engine's flips (see the module docstring). `backend`:
    the ranks' (NCCL: every rank has its own GPU, peers exchange slices device to device)."""
    if not cfg.enable_flip or cfg.world_size < 2 or len(layouts) < 2:
        return WeightsPlan("reload", 0, budget, "no flips")
    quant = engine_quantization(cfg, model_cfg.model_dir)
    parked = parked_bytes(model_cfg, layouts, dtype, quant)
    gib = parked / 2**30
    if cfg.flip_weights != "auto":
        return WeightsPlan(cfg.flip_weights, parked if cfg.flip_weights == "resident" else 0,
                           budget, f"--flip-weights {cfg.flip_weights}")
    if budget is not None and parked <= RESIDENT_MAX_SHARE * budget:
        return WeightsPlan("resident", parked, budget,
                           f"the other layouts' shards take {gib:.2f} GiB per rank, "
                           f"{100 * parked / budget:.1f} % of its {budget / 2**30:.1f} GiB")
    why = ("the rank's budget is unknown" if budget is None else
           f"parking the other layouts would take {gib:.2f} GiB per rank, over "
           f"{100 * RESIDENT_MAX_SHARE:.0f} % of its {budget / 2**30:.1f} GiB")
    if backend == "nccl":
        return WeightsPlan("peer", 0, budget, f"{why}; the ranks' GPUs exchange the slices "
                           "they lack over NCCL")
    if cfg.load_format == "dummy":
        return WeightsPlan("reload", 0, budget, f"{why}; dummy weights have no checkpoint "
                           "to image")
    return WeightsPlan("host-image", 0, budget, why)


def strategy_of(load: Any) -> str:
    """The strategy a `WeightsLoad` used."""
    return load.source if load.source in ("host-image", "resident", "peer") else "reload"


def load_gbps(load: Any) -> float | None:
    """A `WeightsLoad`'s bytes moved over its whole load, GB/s (None: nothing moved, or
    unmeasured)."""
    moved = load.bytes_moved
    return moved / load.load_s / 1e9 if moved and load.load_s else None


def device_free_bytes(device: torch.device) -> int | None:
    """cudaMemGetInfo's free bytes (the whole device, every process on it); None off CUDA."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def record_weights(census: Any, load: Any) -> None:
    """Rank 0's load of its shard, into the seam census."""
    census.weights = strategy_of(load)
    census.weights_load_s, census.weights_read_s = load.load_s, load.read_s
    census.weights_h2d_wait_s, census.weights_drain_s = load.h2d_wait_s, load.drain_s
    census.weights_bytes_moved = load.bytes_moved
    census.weights_gbps = load_gbps(load)


def build_report(rank: int, runner: Any) -> dict[str, Any]:
    """One rank's build of a layout as a seam's census lists it: its weights' strategy, bytes
    moved onto its device, load time and rate, and its device's free memory after the build
    (None off CUDA, law 5)."""
    load = runner.weights_load
    return {"rank": rank, "weights": strategy_of(load), "bytes_moved": load.bytes_moved,
            "load_s": load.load_s, "gbps": load_gbps(load),
            "device_free_after_bytes": device_free_bytes(runner.device)}
