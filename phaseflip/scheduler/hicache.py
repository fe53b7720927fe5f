"""The HiCache controller: device prefixes written through to host (and disk) pages, and read
back into the device prefix tree on admission instead of being recomputed.

Pages are `hicache_page_size` consecutive tokens of a sequence, keyed by a hash chain of their
token ids salted with the model fingerprint, stored in the canonical layout-free format
(`cache/hicache/page.py`). Write-through happens when the scheduler publishes computed KV to
the radix tree; read-through happens just before admission: every page of the request's
prompt that follows its device-cached prefix and exists in a tier is loaded into fresh device
slots and inserted into the tree, so admission matches it like any cached prefix and the
request is priced by its uncached tokens only.

Transfers are synchronous in this version (the loop waits for them); see docs/architecture.md.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from phaseflip.cache.hicache import (
    CorruptPageError,
    DiskPageStore,
    HostPagePool,
    PageGeometry,
    decode_page,
    gather_page,
    model_fingerprint,
    page_keys,
    scatter_page,
)
from phaseflip.cache.kv_pool import KVPool
from phaseflip.config import EngineConfig
from phaseflip.model.config import ModelConfig
from phaseflip.scheduler.kv_cache import KVCacheManager

log = logging.getLogger("phaseflip.hicache")


@dataclass
class HiCacheStats:
    pages_written: int = 0
    bytes_written: int = 0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    miss_pages: int = 0
    corrupt_pages: int = 0
    bytes_loaded: int = 0


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


class HiCache:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, kv: KVCacheManager,
                 pool: KVPool) -> None:
        self.kv, self.pool = kv, pool
        self.page_size = cfg.hicache_page_size
        raw = {k: v for k, v in vars(model_cfg).items() if k not in ("model_dir",
                                                                     "generation_defaults")}
        self.fingerprint = model_fingerprint(
            {k: str(v) for k, v in raw.items()}, pool.dtype,
            weights_id=weights_id(model_cfg.model_dir, cfg.load_format, cfg.seed))
        geo = PageGeometry(pool.dtype, self.page_size, model_cfg.num_layers,
                           model_cfg.num_kv_heads, model_cfg.head_dim)
        pages = max(1, int(cfg.hicache_host_gb * 2**30 // geo.total_size))
        self.host = HostPagePool(pages, geo.total_size, fingerprint=self.fingerprint)
        self.disk = (DiskPageStore(cfg.hicache_dir, self.fingerprint,
                                   int(cfg.hicache_disk_gb * 2**30))
                     if cfg.hicache_dir else None)
        self.stats = HiCacheStats()

    def _keys(self, token_ids: list[int]) -> list[bytes]:
        return page_keys(token_ids, self.page_size, self.fingerprint)

    # ------------------------------------------------------------------ write-through
    def store(self, token_ids: list[int], slots: torch.Tensor) -> None:
        """Writes every full page of `token_ids` (whose KV sits at `slots`) that no tier has."""
        for i, key in enumerate(self._keys(token_ids)):
            if self.host.contains(key):
                continue
            page_slots = slots[i * self.page_size : (i + 1) * self.page_size].to(
                self.pool.k[0].device)
            k, v = gather_page(self.pool.k, self.pool.v, page_slots)
            if not self.host.put(key, (k, v)):
                return  # every frame pinned: skip, the tree still has the KV
            self.stats.pages_written += 1
            if self.disk is not None and not self.disk.contains(key):
                view = self.host.acquire(key)
                try:
                    if self.disk.put(key, view):
                        self.stats.bytes_written += len(view)
                finally:
                    self.host.unpin(key)

    # ------------------------------------------------------------------ read-through
    def load_prefix(self, token_ids: list[int]) -> int:
        """Loads the pages of `token_ids` that follow its device-cached prefix from the host or
        disk tier into the device prefix tree. Returns the tokens loaded."""
        tree = self.kv.tree
        match = tree.match_prefix(token_ids)
        first = int(match.slots.numel()) // self.page_size
        keys = self._keys(token_ids)
        loaded, node = 0, match.last_node
        tree.inc_lock_ref(node)  # what is matched or loaded so far must survive _make_room
        try:
            for i in range(first, len(keys)):
                if not self._load_page(token_ids, i, keys[i]):
                    break
                loaded += self.page_size
                new = tree.match_prefix(token_ids[: (i + 1) * self.page_size]).last_node
                tree.inc_lock_ref(new)
                tree.dec_lock_ref(node)
                node = new
        finally:
            tree.dec_lock_ref(node)
        return loaded

    def _load_page(self, token_ids: list[int], i: int, key: bytes) -> bool:
        page = self._fetch(key)
        if page is None:
            self.stats.miss_pages += 1
            return False
        try:
            k, v = decode_page(page, self.fingerprint)
        except CorruptPageError as e:
            log.warning("HiCache page %s unusable (%s); treated as a miss", key.hex(), e)
            self.stats.corrupt_pages += 1
            self.host.delete(key)
            return False
        if not self._make_room():
            return False
        slots = self.kv.allocator.alloc_slots(self.page_size // self.kv.page_size)
        dev = self.pool.k[0].device
        scatter_page(k.to(dev), v.to(dev), self.pool.k, self.pool.v, slots.to(dev))
        start = i * self.page_size
        tree = self.kv.tree
        prefix = tree.match_prefix(token_ids[:start]).slots
        if prefix.numel() != start:
            raise RuntimeError(f"HiCache: locked prefix shrank to {prefix.numel()} < {start}")
        dup = tree.insert(token_ids[: start + self.page_size], torch.cat([prefix, slots]))
        if dup > start:  # part of the page was already on the device
            self.kv.allocator.free(slots[: dup - start])
        self.stats.bytes_loaded += len(page)
        return True

    def _make_room(self) -> bool:
        short = self.page_size - self.kv.allocator.free_slots
        if short > 0:
            self.kv.tree.evict(short)
        return self.kv.allocator.free_slots >= self.page_size

    def _fetch(self, key: bytes) -> bytes | None:
        view = self.host.acquire(key)
        if view is not None:
            try:
                data = bytes(view)
            finally:
                self.host.unpin(key)
            self.stats.host_hit_tokens += self.page_size
            return data
        if self.disk is None:
            return None
        data = self.disk.get(key)
        if data is not None:
            self.stats.disk_hit_tokens += self.page_size
            self.host.put(key, data)  # promote: the next reader finds it in memory
        return data
