"""Helpers of the RadixCache tests: a cache over a fresh allocator, page-expanded keys, and the
accounting/partition check every test ends with."""

from __future__ import annotations

import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.cache.radix_cache import RadixCache


def make(
    page_size: int, num_pages: int = 64, enabled: bool = True
) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, page_size, enabled=enabled)


def expand(units: list[int], ps: int) -> list[int]:
    """A key in page units: each unit becomes one page of `ps` equal tokens."""
    return [u for u in units for _ in range(ps)]


def alloc_for(alloc: PageAllocator, n_tokens: int) -> torch.Tensor:
    assert n_tokens % alloc.page_size == 0
    s = alloc.alloc_slots(n_tokens // alloc.page_size)
    assert s is not None, "test pool too small"
    return s


def insert_fresh(
    alloc: PageAllocator, cache: RadixCache, key: list[int]
) -> tuple[torch.Tensor, int]:
    """Insert `key` with freshly allocated slots, freeing the duplicates as the contract says."""
    value = alloc_for(alloc, len(key))
    r = cache.insert(key, value)
    alloc.free(value[:r])
    return value, r


def check_accounting(alloc: PageAllocator, cache: RadixCache, private: list[torch.Tensor]) -> None:
    cache.check_integrity()
    n_private = sum(int(p.numel()) for p in private)
    assert (
        alloc.free_slots + cache.evictable_size() + cache.protected_size() + n_private
        == alloc.total_slots
    )
    assert cache.total_size() == cache.evictable_size() + cache.protected_size()
    everything = torch.cat(
        [cache.tree_slots(), alloc.pages_to_slots(alloc.free_page_ids()), *private]
    )
    expected = torch.arange(alloc.page_size, alloc.num_pages * alloc.page_size)
    assert torch.equal(everything.sort().values, expected), "a slot is lost or owned twice"


def freed_since(alloc: PageAllocator, before: torch.Tensor) -> set[int]:
    return set(alloc.free_page_ids().tolist()) - set(before.tolist())


def pages_of(value: torch.Tensor, ps: int) -> set[int]:
    return set((value[::ps] // ps).tolist())
