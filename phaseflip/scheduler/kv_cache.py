"""KV holdings of requests: matching cached prefixes, allocating slots, handing KV back.

Owns the slot space (page allocator), the radix prefix tree and the request→token table, and
keeps them consistent: every usable slot is, at any idle point, exactly one of free, evictable
(in the tree, unlocked), protected (in the tree, locked by a request) or private to a request.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.cache.radix_cache import RadixCache
from phaseflip.scheduler.request import Req


@dataclass(frozen=True)
class PoolAccounting:
    total: int
    free: int
    evictable: int
    protected: int
    private: int
    withheld: int = 0  # held by HiCache loads in flight: allocated, in no tree or request yet

    @property
    def locked(self) -> int:
        return self.protected + self.private

    @property
    def balanced(self) -> bool:
        return self.total == self.free + self.evictable + self.locked + self.withheld


class KVCacheManager:
    def __init__(
        self, num_slots: int, page_size: int, max_requests: int, max_context: int,
        enable_prefix_cache: bool,
    ) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_slots // page_size, page_size)
        self.tree = RadixCache(self.allocator, page_size, enabled=enable_prefix_cache)
        self.table = ReqToTokenTable(max_requests, max_context)
        # numpy view of the (host) table for scalar reads/writes: ~0.1 us against torch's 1-3 us
        self._table_np = self.table.table.numpy()
        # called with (token_ids, slots) of every computed prefix published to the tree
        self.on_publish: Callable[[list[int], torch.Tensor], None] | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.total_slots

    def available(self) -> int:
        return self.allocator.free_slots + self.tree.evictable_size()

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    # ------------------------------------------------------------------ admission
    def admit(self, req: Req, match_limit: int) -> bool:
        """Takes a table row and locks the longest cached prefix of `req`'s tokens (at most
        `match_limit` tokens). False, with nothing held, when no row is free."""
        row = self.table.alloc()
        if row is None:
            return False
        match = self.tree.match_prefix(req.all_ids[:match_limit])
        n = int(match.slots.numel())
        self.tree.inc_lock_ref(match.last_node)
        self.table.write(row, 0, match.slots)
        req.row, req.last_node = row, match.last_node
        req.kv_len = req.alloc_len = req.protected_len = n
        return True

    def allocate(self, req: Req, num_tokens: int) -> torch.Tensor | None:
        """Slots for tokens [alloc_len, alloc_len + num_tokens) of `req`, evicting cached
        prefixes if needed; None (nothing allocated) when the pool cannot provide them. The
        slots are returned as a view of the request's table row."""
        if num_tokens == 1:
            return self._allocate_one(req)
        start, ps = req.alloc_len, self.page_size
        tail_free = (-start) % ps  # unused slots in the request's last page
        new_pages = math.ceil(max(0, num_tokens - tail_free) / ps)
        if new_pages:
            self._make_room(new_pages * ps)
            fresh = self.allocator.alloc_slots(new_pages)
            if fresh is None:
                return None
        else:
            fresh = torch.empty(0, dtype=torch.int64)
        row = self.table.table[req.row]
        if tail_free:
            last = int(row[start - 1])
            tail = torch.arange(last + 1, last + 1 + tail_free, dtype=torch.int64)
            fresh = torch.cat([tail, fresh])
        self.table.write(req.row, start, fresh[:num_tokens])
        req.alloc_len += num_tokens
        return row[start : start + num_tokens]

    def _allocate_one(self, req: Req) -> torch.Tensor | None:
        """`allocate(req, 1)` in plain integers: the decode step calls it for every running
        request, and the general path's dozen small tensor ops cost ~25 us each time."""
        start, ps = req.alloc_len, self.page_size
        if start % ps:  # the next slot of the request's last page
            slot = int(self._table_np[req.row, start - 1]) + 1
        else:
            self._make_room(ps)
            page = self.allocator.alloc_page()
            if page is None:
                return None
            slot = page * ps
        self._table_np[req.row, start] = slot
        req.alloc_len = start + 1
        return self.table.table[req.row, start : start + 1]

    def _make_room(self, slots: int) -> None:
        """Evicts unlocked cached prefixes until `slots` slots are free (or nothing is left)."""
        short = slots - self.allocator.free_slots
        if short > 0:
            self.tree.evict(short)

    def allocate_decode(self, reqs: list[Req]) -> bool:
        """One slot each for the next token of every request in `reqs` (`allocate(r, 1)` for
        all of them) in a few array operations; False, with nothing allocated, when the pool
        cannot provide the pages. The decode step's allocation: 256 calls of `allocate` cost
        ~0.6 ms of host time a step, this ~30 us."""
        if not reqs:
            return True
        ps, t = self.page_size, self._table_np
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.alloc_len for r in reqs), dtype=np.int64, count=len(reqs))
        slots = np.empty(len(reqs), dtype=np.int64)
        fresh = starts % ps == 0  # the next token opens a new page
        n_fresh = int(fresh.sum())
        if n_fresh:
            self._make_room(n_fresh * ps)
            pages = self.allocator.alloc_pages(n_fresh)
            if pages is None:
                return False
            slots[fresh] = pages.numpy() * ps
        if n_fresh < len(reqs):  # the next slot of the request's last page
            tail = ~fresh
            slots[tail] = t[rows[tail], starts[tail] - 1] + 1
        t[rows, starts] = slots
        for r in reqs:
            r.alloc_len += 1
        return True

    def decode_pages(self, reqs: list[Req]) -> int:
        """Pages the next token of every request in `reqs` opens (`allocate_decode`'s fresh
        pages; `pages_needed(r, 1)` summed without a call a request)."""
        ps = self.page_size
        return sum(1 for r in reqs if r.alloc_len % ps == 0)

    def pages_needed(self, req: Req, num_tokens: int) -> int:
        short = num_tokens - (-req.alloc_len) % self.page_size
        return -(-short // self.page_size) if short > 0 else 0

    # ------------------------------------------------------------------ release
    def cache_unfinished(self, req: Req) -> None:
        """Publishes `req`'s computed KV to the tree (so concurrent requests can share it) and
        moves its lock to the new deepest node; duplicate private slots are freed and replaced
        by the tree's own."""
        if not self.tree.enabled:
            return
        aligned = self._aligned(req.kv_len)
        if aligned <= req.protected_len:
            return
        row = self.table.table[req.row]
        self._insert(req, aligned, row[:aligned].clone())
        match = self.tree.match_prefix(req.all_ids[:aligned])
        if match.slots.numel() != aligned:
            raise RuntimeError(
                f"request {req.rid}: tree holds {match.slots.numel()} of {aligned} tokens just "
                "inserted"
            )
        self.tree.inc_lock_ref(match.last_node)
        self.tree.dec_lock_ref(req.last_node)
        self.table.write(req.row, 0, match.slots)
        req.last_node, req.protected_len = match.last_node, aligned

    def release(self, req: Req) -> None:
        """Hands back every slot `req` holds: computed full pages go to the tree (evictable),
        the rest to the allocator. Leaves `req` holding nothing."""
        if req.row is None:
            return
        if req.alloc_len != req.kv_len:
            raise RuntimeError(f"request {req.rid} released with uncomputed slots")
        row = self.table.table[req.row]
        aligned = self._aligned(req.kv_len)
        self._insert(req, aligned, row[:aligned].clone())
        end = math.ceil(req.alloc_len / self.page_size) * self.page_size
        if end > aligned:  # the partial last page: its slots are contiguous in one page
            first = int(row[aligned]) - int(row[aligned]) % self.page_size
            self.allocator.free(torch.arange(first, first + self.page_size, dtype=torch.int64))
        self.tree.dec_lock_ref(req.last_node)
        self.table.free(req.row)
        req.row, req.last_node = None, None
        req.kv_len = req.alloc_len = req.protected_len = 0

    def _insert(self, req: Req, aligned: int, slots: torch.Tensor) -> None:
        if self.on_publish is not None and aligned:
            self.on_publish(req.all_ids[:aligned], slots)  # before duplicates are freed
        dup = self.tree.insert(req.all_ids[:aligned], slots)
        if self.tree.enabled and dup < req.protected_len:
            raise RuntimeError(
                f"request {req.rid}: its locked prefix ({req.protected_len} tokens) is missing "
                f"from the tree ({dup} found)"
            )
        if dup > req.protected_len:
            self.allocator.free(slots[req.protected_len : dup])

    # ------------------------------------------------------------------ checks
    def accounting(self, running: list[Req], withheld: int = 0) -> PoolAccounting:
        """`withheld`: the slots HiCache loads in flight hold (0 at idle: the scheduler
        quiesces the controller before it reports idle)."""
        return PoolAccounting(
            total=self.allocator.total_slots,
            free=self.allocator.free_slots,
            evictable=self.tree.evictable_size(),
            protected=self.tree.protected_size(),
            private=sum(r.private_slots(self.page_size) for r in running),
            withheld=withheld,
        )

    def check(self, running: list[Req]) -> PoolAccounting:
        """Raises naming the numbers if the pool does not balance or the tree is inconsistent."""
        acc = self.accounting(running)
        if not acc.balanced:
            owners = ", ".join(f"{r.rid}:{r.private_slots(self.page_size)}" for r in running)
            raise RuntimeError(f"KV pool accounting broken: {acc} (private holders: {owners})")
        self.tree.check_integrity()
        return acc
