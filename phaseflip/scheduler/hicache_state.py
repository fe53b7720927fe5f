"""What the HiCache controller (`scheduler.hicache`) counts and tracks: its stats, the records
of stores and loads in flight, and the identities of its tiers (which weights, which KV dtype)
— the plain data apart from the controller's logic."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from phaseflip.cache.kv_pool import kv_cache_dtype
from phaseflip.config import EngineConfig
from phaseflip.model.config import ModelConfig
from phaseflip.model.quant.checkpoint import engine_quantization
from phaseflip.model.runner import resolve_dtype

PROMOTING, COPYING, LOADED = "promoting", "copying", "loaded"


@dataclass
class HiCacheStats:
    pages_written: int = 0  # pages stored device -> host tier (copy done)
    bytes_written: int = 0  # bytes written to the disk tier
    host_hit_tokens: int = 0  # prompt tokens loaded from pages found in the host tier
    disk_hit_tokens: int = 0  # prompt tokens loaded from pages read from disk for the load
    miss_pages: int = 0  # admitted requests whose cached prefix stopped at a page no tier has
    corrupt_pages: int = 0  # disk pages found corrupt (deleted, served as misses)
    bytes_loaded: int = 0  # host -> device
    bytes_stored: int = 0  # device -> host
    host_evictions: int = 0
    disk_evictions: int = 0
    disk_writes_dropped: int = 0  # disk copies skipped because the write queue was full
    disk_write_failures: int = 0  # disk copies that failed (full disk, permissions, ...)
    disk_read_errors: int = 0  # disk pages that could not be read (an OS error: a miss)
    foreign_pages: int = 0  # disk pages of another model (weights, KV dtype) met, left alone
    sync_writebacks: int = 0  # write-back pages copied synchronously at eviction
    stores_in_flight: int = 0  # pages being copied device -> host now
    loads_in_flight: int = 0  # pages being promoted or copied host -> device now
    # Dispatch-to-seen-done seconds of the copies. Completion is polled once a step, so these
    # over-count and the rates below under-state the link: an observed floor, not a ceiling.
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    store_gbps: float | None = None  # bytes_stored / store_seconds; None before any store
    load_gbps: float | None = None  # bytes_loaded / load_seconds; None before any load


@dataclass(eq=False)
class StoreJob:
    keys: list[bytes]
    frames: list[int]
    node: Any  # the locked tree node whose path holds the source slots (None: no lock)
    ticket: object
    dispatched: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class LoadJob:
    tokens: list[int]  # the prompt prefix, up to the last page to load
    start: int  # first token of the first loaded page (page aligned)
    keys: list[bytes]  # pages to load, consecutive from `start`
    base: Any  # locked node ending at `start`: the prefix the pages extend
    spare_tokens: int  # slots the scheduler keeps for running requests
    # Every page of `keys` is, for this job, pinned in the host tier (found there at prefetch,
    # or landed from disk), or promoting (on its way from disk), until the copy is done: a
    # page is never evicted between the prefetch that chose it and the load that reads it.
    pinned: set[bytes] = field(default_factory=set)
    promoting: set[bytes] = field(default_factory=set)
    from_disk: set[bytes] = field(default_factory=set)  # pinned pages that landed from disk
    state: str = PROMOTING
    frames: list[int] = field(default_factory=list)  # pinned host frames while copying
    slots: torch.Tensor | None = None  # the in-flight slots (held by this job until inserted)
    ticket: object = None
    dispatched: float = 0.0  # perf_counter when the host -> device copy was ordered
    hold: Any = None  # locked node after insertion, until the request's admission step ends


def weights_id(model_dir: str, load_format: str, seed: int) -> bytes:
    """Tells checkpoints of one architecture apart without reading them whole: names, sizes
    and the first and last 64 KiB of every weight file."""
    h = hashlib.blake2b(digest_size=16)
    if load_format == "dummy":
        h.update(f"dummy-seed-{seed}".encode())
        return h.digest()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f.name.encode() + size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            h.update(fh.read(65536))
            fh.seek(max(0, size - 65536))
            h.update(fh.read(65536))
    return h.digest()


def kv_producer_id(cfg: EngineConfig, model_cfg: ModelConfig) -> bytes:
    """What besides the config and the KV dtype decides the KV of a token sequence: the weights
    (`weights_id`), how they run (`--quantization fp8` quantizes a float checkpoint at load)
    and the compute dtype (FP8 KV is the same page dtype under bf16 and fp16 compute). Pages
    of engines that differ in any of these never read each other."""
    scheme = engine_quantization(cfg, model_cfg.model_dir)
    quant = "none" if scheme is None else f"{scheme.source}:{scheme.block}"  # not lm_head: no KV
    model = _model_dtype(cfg, model_cfg)
    return weights_id(model_cfg.model_dir, cfg.load_format, cfg.seed) + (
        f"|quant={quant}|compute={model}".encode())


def _model_dtype(cfg: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    return resolve_dtype(cfg.dtype, model_cfg, torch.device("cuda" if cuda else "cpu"))


def kv_dtype(cfg: EngineConfig, model_cfg: ModelConfig) -> torch.dtype:
    """The KV dtype of every layout of `cfg` (it follows the device kind, not the layout), known
    before the first runner exists: the host tier is made first."""
    model = _model_dtype(cfg, model_cfg)
    return kv_cache_dtype(cfg.kv_cache_dtype, model)  # FP8 pages with --kv-cache-dtype
