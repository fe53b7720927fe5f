"""RadixCache: prefix matching/splitting, insert ownership, locks, LRU eviction, accounting.

The accounting identity checked throughout is the one the engine asserts at idle:
    allocator.free_slots + evictable_size() + protected_size() + private == total_slots
where `private` is what simulated running requests hold outside the tree. Every test also checks
the stronger partition property: each usable slot is free, in the tree, or private, exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from phaseflip.cache.allocator import PageAllocator
from phaseflip.cache.radix_cache import RadixCache
from tests.radix_helpers import (
    alloc_for,
    check_accounting,
    expand,
    freed_since,
    insert_fresh,
    make,
    pages_of,
)

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
