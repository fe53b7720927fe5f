"""RadixCache invariants: `check_integrity` catches every kind of corruption, and a randomized
scheduler-like drive keeps the accounting identity and the partition property at every step
(see tests/test_radix_cache.py for the identity)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.cache.radix_cache import RadixCache, TreeNode
from tests.radix_helpers import (
    check_accounting,
    insert_fresh,
    make,
)


def _corrupt_counter(c: RadixCache) -> None:
    c._evictable += 1


def _corrupt_lock_order(c: RadixCache) -> None:
    leaf = c.match_prefix([1, 2, 3]).last_node
    leaf.lock_ref = 1  # without its parent


def _corrupt_negative_lock(c: RadixCache) -> None:
    c.match_prefix([1, 2, 3]).last_node.lock_ref = -1


def _corrupt_duplicate_slot(c: RadixCache) -> None:
    a = c.match_prefix([1, 2, 3]).last_node
    b = c.match_prefix([1, 2, 4]).last_node
    b.value = a.value.clone()


def _corrupt_parent_link(c: RadixCache) -> None:
    c.match_prefix([1, 2, 3]).last_node.parent = c.root


def _corrupt_value_len(c: RadixCache) -> None:
    n = c.match_prefix([1, 2]).last_node
    n.value = n.value[:1]


def _corrupt_child_key(c: RadixCache) -> None:
    n = c.match_prefix([1, 2]).last_node
    n.key = [9, 2]


@pytest.mark.parametrize(
    "corrupt",
    [
        _corrupt_counter,
        _corrupt_lock_order,
        _corrupt_negative_lock,
        _corrupt_duplicate_slot,
        _corrupt_parent_link,
        _corrupt_value_len,
        _corrupt_child_key,
    ],
)
def test_check_integrity_detects_corruption(corrupt: Callable[[RadixCache], None]) -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3])
    insert_fresh(alloc, cache, [1, 2, 4])
    cache.check_integrity()
    corrupt(cache)
    with pytest.raises(RuntimeError, match="integrity"):
        cache.check_integrity()


# ---------------------------------------------------------------------------- randomized


class _Sim:
    """Drives a cache the way the scheduler does, with an oracle for every match.

    `content[slot]` records the prefix whose last token's KV a slot holds (what a forward would
    have written there); a match is correct iff each returned slot holds exactly that prefix.
    """

    def __init__(self, ps: int, seed: int) -> None:
        self.ps = ps
        self.rng = random.Random(seed)
        self.alloc = PageAllocator(24, ps)
        self.cache = RadixCache(self.alloc, ps)
        self.content: dict[int, tuple[int, ...]] = {}
        # running requests: (key, matched prefix slots, locked node, private slots)
        self.active: list[tuple[list[int], torch.Tensor, TreeNode, torch.Tensor]] = []
        if ps == 1:
            self.words = [[0], [1], [2]]
        else:  # pages that share first tokens, so mismatches land inside pages
            self.words = [[0, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 1]]

    def rand_key(self, max_pages: int = 5) -> list[int]:
        return [
            t for _ in range(self.rng.randint(1, max_pages)) for t in self.rng.choice(self.words)
        ]

    def stored_prefixes(self) -> set[tuple[int, ...]]:
        out: set[tuple[int, ...]] = set()
        stack: list[tuple[TreeNode, list[int]]] = [(self.cache.root, [])]
        while stack:
            node, path = stack.pop()
            full = path + node.key
            for k in range(len(path) + self.ps, len(full) + 1, self.ps):
                out.add(tuple(full[:k]))
            stack.extend((c, full) for c in node.children.values())
        return out

    def checked_match(self, key: list[int]) -> tuple[torch.Tensor, TreeNode]:
        prefixes = self.stored_prefixes()
        expected = max(
            (k for k in range(self.ps, len(key) + 1, self.ps) if tuple(key[:k]) in prefixes),
            default=0,
        )
        m = self.cache.match_prefix(key)
        assert m.length == expected
        for i, s in enumerate(m.slots.tolist()):
            assert self.content[s] == tuple(key[: i + 1]), "matched slot holds another prefix"
        depth = 0
        n: TreeNode | None = m.last_node
        while n is not None:
            depth += len(n.key)
            n = n.parent
        assert depth == m.length, "last_node does not end exactly at the match"
        return m.slots, m.last_node

    def alloc_tokens(self, key: list[int], start: int) -> torch.Tensor | None:
        n_pages = (len(key) - start) // self.ps
        if self.alloc.free_pages < n_pages:
            self.cache.evict((n_pages - self.alloc.free_pages) * self.ps)
        slots = self.alloc.alloc_slots(n_pages)
        if slots is not None:
            for i, s in enumerate(slots.tolist()):
                self.content[s] = tuple(key[: start + i + 1])
        return slots

    def private(self) -> list[torch.Tensor]:
        return [p for *_, p in self.active]

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.25:  # a request starts: match, lock, allocate the rest privately
            key = self.rand_key()
            prefix, node = self.checked_match(key)
            self.cache.inc_lock_ref(node)
            slots = self.alloc_tokens(key, prefix.numel())
            if slots is None:
                self.cache.dec_lock_ref(node)
            else:
                self.active.append((key, prefix, node, slots))
        elif op < 0.45 and self.active:  # a request finishes: insert, free dups, unlock
            key, prefix, node, slots = self.active.pop(self.rng.randrange(len(self.active)))
            if self.rng.random() < 0.2:  # aborted: nothing cached
                self.alloc.free(slots)
            else:
                value = torch.cat([prefix, slots])
                r = self.cache.insert(key, value)
                assert r >= prefix.numel()
                self.alloc.free(value[prefix.numel() : r])
                assert self.checked_match(key)[0].numel() == len(key)
            self.cache.dec_lock_ref(node)
        elif op < 0.6:  # insert without a prior match: leading slots are duplicates
            key = self.rand_key()
            slots = self.alloc_tokens(key, 0)
            if slots is not None:
                r = self.cache.insert(key, slots)
                self.alloc.free(slots[:r])
                assert self.checked_match(key)[0].numel() == len(key)
        elif op < 0.8:  # a lookup, possibly not page aligned
            self.checked_match(self.rand_key() + [0] * self.rng.randrange(self.ps))
        elif op < 0.97:
            before = self.alloc.free_slots
            freed = self.cache.evict(self.rng.randint(0, self.cache.total_size() + 1))
            assert self.alloc.free_slots == before + freed
        else:
            locked = self.cache.protected_size() > 0
            if locked:
                with pytest.raises(RuntimeError):
                    self.cache.evict_all_and_reset()
                assert self.cache.evictable_size() == 0
            else:
                self.cache.evict_all_and_reset()
                assert self.cache.total_size() == 0
        check_accounting(self.alloc, self.cache, self.private())


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_accounting(ps: int, seed: int) -> None:
    sim = _Sim(ps, seed)
    for _ in range(400):
        sim.step()
    # drain: finish everything, then the tree empties completely
    while sim.active:
        _, _, node, slots = sim.active.pop()
        sim.alloc.free(slots)
        sim.cache.dec_lock_ref(node)
    sim.cache.evict_all_and_reset()
    check_accounting(sim.alloc, sim.cache, [])
    assert sim.alloc.free_slots == sim.alloc.total_slots
