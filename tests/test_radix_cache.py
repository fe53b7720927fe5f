"""RadixCache: prefix matching/splitting, insert ownership, locks, LRU eviction, accounting.

The accounting identity checked throughout is the one the engine asserts at idle:
    allocator.free_slots + evictable_size() + protected_size() + private == total_slots
where `private` is what simulated running requests hold outside the tree. Every test also checks
the stronger partition property: each usable slot is free, in the tree, or private, exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.cache.radix_cache import RadixCache, TreeNode

# ---------------------------------------------------------------------------- helpers


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


# ---------------------------------------------------------------------------- matching / splits


@pytest.mark.parametrize(
    ("ps", "stored", "query", "matched", "last_key", "child_keys"),
    [
        # page_size 1: the match ends inside the node -> split at the mismatch
        (1, [1, 2, 3, 4, 5, 6], [1, 2, 3, 9], 3, [1, 2, 3], [[4, 5, 6]]),
        (1, [1, 2, 3, 4, 5, 6], [1, 2, 3], 3, [1, 2, 3], [[4, 5, 6]]),
        # full node match, query longer: no split
        (1, [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7], 6, [1, 2, 3, 4, 5, 6], []),
        (1, [1, 2, 3], [9], 0, [], [[1, 2, 3]]),
        # page_size 4: splits only at page boundaries
        (
            4,
            list(range(1, 13)),
            list(range(1, 9)) + [99] * 4,
            8,
            list(range(1, 9)),
            [[9, 10, 11, 12]],
        ),
        # mismatch inside the second page -> match truncated to the first page
        (4, list(range(1, 13)), [1, 2, 3, 4, 5, 6, 99, 8], 4, [1, 2, 3, 4], [list(range(5, 13))]),
        # a 7-token query matches 4 (page aligned)
        (4, list(range(1, 9)), list(range(1, 8)), 4, [1, 2, 3, 4], [[5, 6, 7, 8]]),
        # shorter than a page: empty match
        (4, list(range(1, 9)), [1, 2, 3], 0, [], [list(range(1, 9))]),
        # first page differs in its last token: empty match
        (4, list(range(1, 9)), [1, 2, 3, 5], 0, [], [list(range(1, 9))]),
    ],
)
def test_match_prefix_splits(
    ps: int,
    stored: list[int],
    query: list[int],
    matched: int,
    last_key: list[int],
    child_keys: list[list[int]],
) -> None:
    alloc, cache = make(ps)
    value, r = insert_fresh(alloc, cache, stored)
    assert r == 0
    before = (cache.evictable_size(), cache.protected_size())
    m = cache.match_prefix(query)
    assert m.length == matched
    assert torch.equal(m.slots, value[:matched])
    assert m.last_node.key == last_key
    if matched == 0:
        assert m.last_node is cache.root
    assert sorted(c.key for c in m.last_node.children.values()) == child_keys
    # splitting moves no tokens between categories
    assert (cache.evictable_size(), cache.protected_size()) == before
    check_accounting(alloc, cache, [])
    # the whole stored key still matches, through the split
    full = cache.match_prefix(stored)
    assert full.length == len(stored) and torch.equal(full.slots, value)


@pytest.mark.parametrize(
    ("ps", "first", "second", "expected_r"),
    [
        (1, [1, 2, 3], [1, 2, 3], 3),  # exact duplicate
        (1, [1, 2, 3], [1, 2, 4], 2),  # diverges: split + new leaf
        (1, [1, 2, 3], [1, 2, 3, 4, 5], 3),  # extends a leaf
        (1, [1, 2, 3, 4], [1, 2], 2),  # strict prefix: split, nothing new
        (1, [1, 2], [3], 0),  # disjoint
        (4, list(range(8)), list(range(8)), 8),
        (4, list(range(8)), list(range(4)) + [9] * 4, 4),
        (4, list(range(8)), [0, 1, 2, 3, 4, 5, 6, 99], 4),  # mismatch in a page's last token
        (4, list(range(8)), list(range(12)), 8),
        (4, list(range(8)), [0, 1, 2, 99], 0),
    ],
)
def test_insert_returns_existing_prefix(
    ps: int, first: list[int], second: list[int], expected_r: int
) -> None:
    alloc, cache = make(ps)
    v1, _ = insert_fresh(alloc, cache, first)
    v2, r = insert_fresh(alloc, cache, second)
    assert r == expected_r
    check_accounting(alloc, cache, [])
    assert cache.total_size() == len(first) + len(second) - r
    # the tree kept its own slots for the shared prefix and took v2's for the rest
    m = cache.match_prefix(second)
    assert m.length == len(second)
    assert torch.equal(m.slots, torch.cat([v1[:r], v2[r:]]))
    # the duplicates went back to the allocator, the rest did not
    assert bool(alloc.is_free_page(v2[:r][::ps] // ps).all())
    assert not bool(alloc.is_free_page(v2[r:][::ps] // ps).any())


def test_insert_after_match_adopts_only_new_slots() -> None:
    """The engine's pattern: match, allocate the rest, insert prefix+new; nothing to free."""
    alloc, cache = make(4)
    insert_fresh(alloc, cache, list(range(8)))
    key = list(range(16))
    m = cache.match_prefix(key)
    assert m.length == 8
    cache.inc_lock_ref(m.last_node)
    new = alloc_for(alloc, 8)
    check_accounting(alloc, cache, [new])
    r = cache.insert(key, torch.cat([m.slots, new]))
    assert r == 8
    alloc.free(torch.cat([m.slots, new])[m.length : r])  # empty: no private duplicates
    cache.dec_lock_ref(m.last_node)
    check_accounting(alloc, cache, [])
    assert cache.total_size() == 16


@pytest.mark.parametrize(
    ("key_len", "value_fn", "exc"),
    [
        (6, lambda a: a.alloc_slots(2)[:6], ValueError),  # not page aligned
        (8, lambda a: a.alloc_slots(1), ValueError),  # length mismatch
        (4, lambda a: a.alloc_slots(2)[2:6], ValueError),  # not whole pages
        (4, lambda a: a.alloc_slots(1).to(torch.int32), ValueError),
        (4, lambda a: torch.arange(4, dtype=torch.int64), RuntimeError),  # page 0
        (4, lambda a: torch.arange(40, 44, dtype=torch.int64), RuntimeError),  # free page
    ],
)
def test_insert_rejects_bad_values(
    key_len: int, value_fn: Callable[[PageAllocator], torch.Tensor], exc: type[Exception]
) -> None:
    alloc, cache = make(4, num_pages=16)
    insert_fresh(alloc, cache, [7] * 4)
    with pytest.raises(exc):
        cache.insert([5] * key_len, value_fn(alloc))
    cache.check_integrity()
    assert cache.total_size() == 4


# ---------------------------------------------------------------------------- LRU eviction


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize(
    ("inserts", "touches", "evict_order"),
    [
        ([[1, 1], [2, 2], [3, 3]], [], [[1, 1], [2, 2], [3, 3]]),
        ([[1, 1], [2, 2], [3, 3]], [[1, 1]], [[2, 2], [3, 3], [1, 1]]),
        ([[1, 1], [2, 2], [3, 3]], [[2, 2], [1, 1]], [[3, 3], [2, 2], [1, 1]]),
        # a partial-prefix touch refreshes the (split) upper node only
        ([[1, 1, 1], [2, 2]], [[1, 1, 5]], [[1], [2, 2], [1, 1]]),
        # a parent becomes evictable once its children are gone, ordered by its own access time
        ([[1, 2, 3, 4], [1, 2, 5, 6], [7, 7]], [], [[3, 4], [5, 6], [1, 2], [7, 7]]),
        ([[1, 2, 3, 4], [1, 2, 5, 6], [7, 7]], [[1, 2, 3]], [[4], [5, 6], [7, 7], [3], [1, 2]]),
    ],
)
def test_lru_eviction_order(
    ps: int, inserts: list[list[int]], touches: list[list[int]], evict_order: list[list[int]]
) -> None:
    alloc, cache = make(ps)
    units_to_pages: dict[tuple[int, ...], set[int]] = {}
    for units in inserts:
        insert_fresh(alloc, cache, expand(units, ps))
    for units in touches:
        cache.match_prefix(expand(units, ps))
    # identify each node's pages from the tree itself, by its key
    for node in cache._nodes():
        units_to_pages[tuple(node.key[::ps])] = pages_of(node.value, ps)
    for expected in evict_order:
        before = alloc.free_page_ids()
        freed = cache.evict(1)
        assert freed == len(expected) * ps
        assert freed_since(alloc, before) == units_to_pages[tuple(expected)]
        check_accounting(alloc, cache, [])
    assert cache.total_size() == 0
    assert cache.evict(1) == 0


@pytest.mark.parametrize("ps", [1, 4])
@pytest.mark.parametrize(
    ("request_tokens", "expected_freed"),
    [
        (0, 0),
        (1, 3),  # a request of one token still frees the whole LRU leaf [3,4,5]
        (3, 3),
        (4, 4),  # [3,4,5] then [9]
        (5, 6),  # ... then the parent [1,2], which became a leaf
        (100, 6),  # everything evictable, no more
    ],
)
def test_evict_frees_whole_nodes(ps: int, request_tokens: int, expected_freed: int) -> None:
    alloc, cache = make(ps)
    insert_fresh(alloc, cache, expand([1, 2, 3, 4, 5], ps))
    insert_fresh(alloc, cache, expand([1, 2, 9], ps))  # tree: [1,2] -> {[3,4,5], [9]}
    free_before = alloc.free_slots
    freed = cache.evict(request_tokens * ps)
    assert freed == expected_freed * ps
    assert alloc.free_slots == free_before + freed
    check_accounting(alloc, cache, [])


@pytest.mark.parametrize("ps", [1, 4])
def test_locked_nodes_and_ancestors_never_evicted(ps: int) -> None:
    alloc, cache = make(ps)
    v, _ = insert_fresh(alloc, cache, expand([1, 2, 3, 4], ps))
    insert_fresh(alloc, cache, expand([1, 2, 5, 6], ps))
    insert_fresh(alloc, cache, expand([8, 8], ps))
    m = cache.match_prefix(expand([1, 2, 3, 4], ps))
    # lock the deepest node: [3,4]; its ancestor [1,2] is pinned too
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 * ps
    assert cache.evictable_size() == 4 * ps
    check_accounting(alloc, cache, [])
    assert cache.evict(10**6) == 4 * ps  # only [5,6] and [8,8]
    check_accounting(alloc, cache, [])
    assert cache.evictable_size() == 0
    again = cache.match_prefix(expand([1, 2, 3, 4], ps))
    assert again.length == 4 * ps and torch.equal(again.slots, v)
    assert cache.evict(1) == 0
    # two locks on the same path need two unlocks
    cache.inc_lock_ref(again.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(1) == 0
    cache.dec_lock_ref(again.last_node)
    assert cache.evictable_size() == 4 * ps and cache.protected_size() == 0
    assert cache.evict(1) == 2 * ps  # the leaf [3,4] first, then its parent
    assert cache.evict(1) == 2 * ps
    check_accounting(alloc, cache, [])


def test_lock_on_inner_node_keeps_descendants_evictable() -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2])  # splits; last_node is [1,2]
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 2 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # the unlocked child [3,4]
    assert cache.root.children[1] is m.last_node
    cache.dec_lock_ref(m.last_node)
    check_accounting(alloc, cache, [])


def test_lock_survives_split_of_locked_node() -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock_ref(m.last_node)
    cache.match_prefix([1, 2, 3, 9])  # splits the locked node into [1,2,3] + [4,5,6]
    check_accounting(alloc, cache, [])
    assert m.last_node.key == [4, 5, 6]
    upper = m.last_node.parent
    assert upper is not None and upper.key == [1, 2, 3] and upper.lock_ref == 1
    assert cache.protected_size() == 6
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 6
    check_accounting(alloc, cache, [])


# ---------------------------------------------------------------------------- loud failures


def test_dec_lock_ref_below_zero_raises_and_changes_nothing() -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3])
    insert_fresh(alloc, cache, [1, 2, 4])
    leaf = cache.match_prefix([1, 2, 3]).last_node
    other = cache.match_prefix([1, 2, 4]).last_node
    with pytest.raises(RuntimeError, match="below zero"):
        cache.dec_lock_ref(leaf)
    cache.inc_lock_ref(leaf)
    # `other` has lock 0 but its parent [1,2] has lock 1: still a double release
    with pytest.raises(RuntimeError, match="below zero"):
        cache.dec_lock_ref(other)
    assert leaf.parent is not None and leaf.parent.lock_ref == 1
    cache.dec_lock_ref(leaf)
    with pytest.raises(RuntimeError, match="below zero"):
        cache.dec_lock_ref(leaf)
    check_accounting(alloc, cache, [])


def test_lock_of_evicted_node_raises() -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2])
    node = cache.match_prefix([1, 2]).last_node
    assert cache.evict(2) == 2
    with pytest.raises(RuntimeError, match="not in the tree"):
        cache.inc_lock_ref(node)
    check_accounting(alloc, cache, [])


def test_reset_keeps_root_valid_and_invalidates_old_nodes() -> None:
    alloc, cache = make(1)
    insert_fresh(alloc, cache, [1, 2, 3])
    held_root = cache.match_prefix([9]).last_node  # a request that matched nothing
    cache.inc_lock_ref(held_root)
    old = cache.match_prefix([1, 2, 3]).last_node
    assert cache.evict_all_and_reset() == 3
    cache.dec_lock_ref(held_root)  # still the live root: fine
    with pytest.raises(RuntimeError, match="not in the tree"):
        cache.inc_lock_ref(old)
    check_accounting(alloc, cache, [])


@pytest.mark.parametrize("ps", [1, 4])
def test_evict_all_and_reset(ps: int) -> None:
    alloc, cache = make(ps)
    insert_fresh(alloc, cache, expand([1, 2, 3], ps))
    insert_fresh(alloc, cache, expand([1, 5], ps))
    insert_fresh(alloc, cache, expand([7], ps))
    m = cache.match_prefix(expand([1, 2, 3], ps))
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError, match="protected"):
        cache.evict_all_and_reset()
    # the unlocked nodes were evicted, the locked path survived intact
    check_accounting(alloc, cache, [])
    assert cache.protected_size() == 3 * ps and cache.evictable_size() == 0
    cache.dec_lock_ref(m.last_node)
    assert cache.evict_all_and_reset() == 3 * ps
    assert cache.total_size() == 0 and not cache.root.children
    assert alloc.free_slots == alloc.total_slots
    check_accounting(alloc, cache, [])


def test_evicting_a_slot_freed_behind_the_trees_back_raises() -> None:
    alloc, cache = make(4)
    v, _ = insert_fresh(alloc, cache, list(range(8)))
    alloc.free(v[:4])  # caller bug: freed a tree-owned page
    with pytest.raises(RuntimeError, match="allocator lists as free"):
        cache.check_integrity()
    with pytest.raises(RuntimeError, match="double free"):
        cache.evict(100)


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


def test_page_size_mismatch_rejected() -> None:
    with pytest.raises(ValueError):
        RadixCache(PageAllocator(4, 4), 1)


# ---------------------------------------------------------------------------- disabled cache


@pytest.mark.parametrize("ps", [1, 4])
def test_disabled_cache_stores_nothing(ps: int) -> None:
    alloc, cache = make(ps, enabled=False)
    key = expand([1, 2, 3], ps)
    for _ in range(2):
        m = cache.match_prefix(key)
        assert m.length == 0 and m.last_node is cache.root
        cache.inc_lock_ref(m.last_node)  # no-op on the root
        value = alloc_for(alloc, len(key))
        r = cache.insert(key, value)
        assert r == len(key)  # the caller frees everything
        alloc.free(value[:r])
        cache.dec_lock_ref(m.last_node)
        check_accounting(alloc, cache, [])
    assert cache.total_size() == 0 and cache.evict(100) == 0
    assert cache.evict_all_and_reset() == 0


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
