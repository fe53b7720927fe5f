"""Radix-tree prefix cache over KV slots, with lock reference counts and LRU eviction.

The tree maps token-id sequences to the KV slots that hold their keys/values, so a new request
whose prompt starts with an already-computed prefix reuses those slots instead of recomputing.

Slot ownership (the invariant everything else leans on): every usable slot of the pool is, at any
moment, in exactly one of
  * the allocator's free list,
  * the tree (the `value` of exactly one node), or
  * the private hands of one running request (allocated by it and not yet given to the tree).
Hence, with nothing running, `allocator.free_slots + evictable_size() + protected_size() ==
allocator.total_slots`. The tree frees its slots to the allocator only on eviction; `insert`
takes ownership of the slots it stores and nothing else.

Locks: a running request that reuses a prefix locks the deepest matched node (`inc_lock_ref`),
which pins that node and every ancestor: a node's `lock_ref` counts the locks held on it or on
any descendant, so `child.lock_ref <= parent.lock_ref` always. Only nodes with `lock_ref == 0`
are evictable; their tokens are counted in `evictable_size()`, the rest in `protected_size()`.

Pages: with `page_size > 1` every key and value in the tree is a whole number of pages, matches
are truncated to whole pages and nodes split only at page boundaries, so eviction always frees
whole pages (the allocator's unit).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from phaseflip.cache.allocator import PageAllocator

_EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)

ChildKey = int | tuple[int, ...]


class TreeNode:
    """One edge of the radix tree: the tokens `key` and the slots `value` that hold their KV.

    `children` is keyed by the first token of the child's key (page_size == 1) or by the tuple of
    its first page of tokens (page_size > 1); siblings therefore never share a first page.
    `parent` is None for the root and for a node that was evicted (detached).
    `last_access` is the cache's monotonic access counter at the last match/insert touching this
    node (not wall-clock time, so eviction order is deterministic); `node_id` breaks ties.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "node_id")

    def __init__(
        self,
        node_id: int,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        last_access: float,
    ) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent: TreeNode | None = parent
        self.key: list[int] = key
        self.value: torch.Tensor = value
        self.lock_ref: int = 0
        self.last_access: float = last_access
        self.node_id: int = node_id

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        return (
            f"TreeNode(id={self.node_id}, key={head}{more} len={len(self.key)}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access}, "
            f"children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """Result of `match_prefix`.

    `slots` are the tree's own slots for the matched prefix (the caller must not free them; lock
    `last_node` to keep them alive). `last_node` is the deepest matched node; the match ends
    exactly at its end (the tree was split if needed), or it is the root for an empty match.
    """

    slots: torch.Tensor  # int64 [matched_len], concatenated along the root→last_node path
    last_node: TreeNode

    @property
    def length(self) -> int:
        return int(self.slots.numel())


class RadixCache:
    """Prefix cache: see the module docstring for slot ownership and lock semantics.

    With `enabled=False` (prefix caching off) the tree stays empty: `match_prefix` returns the
    empty match and `insert` stores nothing and tells the caller to free every slot, so the
    engine's code path is the same either way.
    """

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        if page_size != allocator.page_size:
            raise ValueError(
                f"RadixCache page_size={page_size} != allocator page_size={allocator.page_size}"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        # called with (token ids, slots) of a node's whole prefix just before it is evicted
        self.on_evict: Callable[[list[int], torch.Tensor], None] | None = None
        self._next_node_id = 0
        self._clock = 0
        self._root = self._new_node([], _EMPTY_SLOTS, None, 0.0)
        self._evictable = 0  # tokens in non-root nodes with lock_ref == 0
        self._protected = 0  # tokens in non-root nodes with lock_ref > 0

    # ------------------------------------------------------------------ public API

    @property
    def root(self) -> TreeNode:
        return self._root

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest page-aligned prefix of `key` in the tree.

        Splits a node when the match ends inside it, so `last_node` ends exactly at the match
        (which is what a caller locks). Touches the LRU counter of every node on the path.
        """
        ps = self.page_size
        aligned = len(key) - len(key) % ps
        if not self.enabled or aligned == 0:
            return MatchResult(_EMPTY_SLOTS.clone(), self._root)
        node, _, parts = self._descend(key, aligned, self._tick())
        slots = torch.cat(parts) if parts else _EMPTY_SLOTS.clone()
        return MatchResult(slots, node)

    def cached_prefix_len(self, key: list[int]) -> int:
        """How many leading tokens of `key` `match_prefix` would match, read-only: no LRU
        touch, no split (the flip policy prices pending work with it every step)."""
        end = len(key) - len(key) % self.page_size
        if not self.enabled:
            return 0
        node, off = self._root, 0
        while off < end:
            child = node.children.get(self._child_key(key, off))
            if child is None:
                break
            n = self._match_len(child.key, key, off, end)
            off += n
            if n < len(child.key):
                break
            node = child
        return off

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Store `key -> value`; returns how many leading slots of `value` remain the caller's.

        The return value `r` is the length of the prefix of `key` that was already in the tree.
        The tree takes ownership of `value[r:]` (it frees them on eviction); `value[:r]` are NOT
        taken: those of them the caller allocated privately are duplicates it must free itself
        (slots it got from `match_prefix` are the tree's own and must not be freed).
        When the cache is disabled nothing is stored and `len(key)` is returned, so the caller
        frees everything it allocated, exactly as with an all-duplicate insert.

        `key` and `value` must have equal length, a multiple of `page_size`, and `value` must be
        whole allocated pages; otherwise ValueError / RuntimeError and the tree's contents are
        unchanged (at most a content-preserving split happened).
        """
        self._check_insert_args(key, value)
        if not self.enabled:
            return len(key)
        total = len(key)
        now = self._tick()
        node, off, _ = self._descend(key, total, now)
        if off < total:
            new_slots = value[off:]
            pages = torch.div(new_slots[:: self.page_size], self.page_size, rounding_mode="floor")
            if bool(self.allocator.is_free_page(pages).any()):
                raise RuntimeError(
                    f"insert() of slots whose pages are free in the allocator: "
                    f"{pages[self.allocator.is_free_page(pages)].tolist()[:64]}"
                )
            leaf = self._new_node(list(key[off:]), new_slots.clone(), node, now)
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable += total - off
        return off

    def _descend(self, key: list[int], end: int, now: float
                 ) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Walks down the tree along `key[:end]`, splitting the last node if the match ends
        inside it. Returns (deepest matched node, tokens matched, the matched nodes' values)."""
        self._root.last_access = now
        node, off, parts = self._root, 0, []
        while off < end:
            child = node.children.get(self._child_key(key, off))
            if child is None:
                break
            n = self._match_len(child.key, key, off, end)
            if n <= 0:
                raise AssertionError(
                    f"child {child!r} indexed under {key[off : off + self.page_size]} mismatched"
                )
            split = n < len(child.key)
            if split:
                child = self._split(child, n)
            # Only the matched part is touched: after a split the lower node keeps its old time.
            child.last_access = now
            parts.append(child.value)
            node = child
            off += n
            if split:
                break  # the match ended inside the old node: nothing deeper can match
        return node, off, parts

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Pin `node` and its ancestors against eviction (one lock; pair with `dec_lock_ref`).

        Locking the root (an empty match) is a no-op. Raises if `node` is no longer in the tree.
        """
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one lock taken by `inc_lock_ref(node)`. Raises, changing nothing, if any node
        on the path is not locked (a lock released twice)."""
        path = self._path_to_root(node)
        for n in path:
            if n.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref below zero at {n!r} (path from {node!r})")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)
                self._evictable += len(n.key)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots to the allocator by evicting least-recently-used
        unlocked leaves (a parent whose children all went becomes a candidate in turn), or
        everything evictable if that is less. Whole nodes only, so it may free more than asked.
        Returns the number of slots freed."""
        if num_tokens <= 0 or self._evictable == 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self.leaves(unlocked_only=True)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if self.on_evict is not None:  # write-back: the slots are still valid here
                self.on_evict(*self.path_of(node))
            freed += self._evict_leaf(node)
            if (
                parent is not None
                and parent is not self._root
                and not parent.children
                and parent.lock_ref == 0
            ):
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return freed

    def path_of(self, node: TreeNode) -> tuple[list[int], torch.Tensor]:
        """(token ids, slots) of the whole prefix from the root down to `node`."""
        keys, values = [], []
        while node is not None and node is not self._root:
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for k in reversed(keys) for t in k]
        return tokens, torch.cat(values[::-1]) if values else _EMPTY_SLOTS.clone()

    def evictable_size(self) -> int:
        """Tokens (= slots) in nodes with lock_ref == 0: what `evict` could free."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens in nodes with lock_ref > 0: pinned by running requests."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def reset(self) -> None:
        """Drop the whole tree WITHOUT freeing its slots. Only correct when the tree is empty or
        the caller re-owns the slot space (e.g. `allocator.reset()` too); see
        `evict_all_and_reset` for the safe variant."""
        # The root object is kept (only its children go), so a `last_node` that is the root
        # (an empty match held by a running request) stays valid across a reset.
        self._root.children = {}
        self._root.lock_ref = 0
        self._evictable = 0
        self._protected = 0

    def evict_all_and_reset(self) -> int:
        """Evict every unlocked node (freeing its slots), then reset. Raises RuntimeError,
        without resetting, if locked nodes remain (a request still holds a prefix).
        Returns the slots freed."""
        # Every unlocked node eventually becomes an unlocked leaf (a locked descendant would
        # lock it too), so evicting `evictable_size()` tokens empties all unlocked nodes.
        freed = self.evict(self._evictable)
        if self._protected or self._root.children:
            raise RuntimeError(
                f"evict_all_and_reset: {self._protected} protected tokens remain in "
                f"{len(self._root.children)} locked subtree(s) (evictable left: {self._evictable})"
            )
        self.reset()
        return freed

    def tree_slots(self) -> torch.Tensor:
        """All slots the tree owns, concatenated (accounting checks; O(tree))."""
        parts = [n.value for n in self._nodes()]
        return torch.cat(parts) if parts else _EMPTY_SLOTS.clone()

    def check_integrity(self) -> None:
        """Recompute the tree's invariants from scratch; raise RuntimeError listing violations.

        Checks: parent/child links and child-dict keys, non-empty page-aligned keys, values of
        matching length made of whole pages, lock_ref >= 0 and child.lock_ref <= parent.lock_ref,
        evictable/protected counters, no slot owned twice, no page 0, no tree page free in the
        allocator.
        """
        errors = self._root_errors()
        values, evictable, protected = self._walk_edges(errors)
        if evictable != self._evictable:
            errors.append(f"evictable counter {self._evictable} != recomputed {evictable}")
        if protected != self._protected:
            errors.append(f"protected counter {self._protected} != recomputed {protected}")
        if values and not errors:  # slot checks assume well-formed values
            errors.extend(self._slot_errors(torch.cat(values)))
        if errors:
            raise RuntimeError("radix cache integrity check failed:\n  " + "\n  ".join(errors))

    def _root_errors(self) -> list[str]:
        errors: list[str] = []
        root = self._root
        if root.parent is not None or root.key or root.value.numel() or root.lock_ref != 0:
            errors.append(f"malformed root {root!r}")
        if not self.enabled and root.children:
            errors.append("disabled cache has a non-empty tree")
        return errors

    def _walk_edges(self, errors: list[str]) -> tuple[list[torch.Tensor], int, int]:
        """Check every parent->child edge, appending to `errors`; returns the well-formed
        values and the recomputed (evictable, protected) token counts."""
        evictable = protected = 0
        values: list[torch.Tensor] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            for ckey, child in node.children.items():
                stack.append(child)
                where = f"{child!r} under {node!r}"
                if not self._edge_shape_ok(node, ckey, child, where, errors):
                    continue
                values.append(child.value)
                if child.lock_ref < 0:
                    errors.append(f"negative lock_ref: {where}")
                if node is not self._root and child.lock_ref > node.lock_ref:
                    errors.append(f"child locked more than parent: {where}")
                if child.lock_ref > 0:
                    protected += len(child.key)
                else:
                    evictable += len(child.key)
        return values, evictable, protected

    def _edge_shape_ok(self, node: TreeNode, ckey: ChildKey, child: TreeNode, where: str,
                       errors: list[str]) -> bool:
        """Link, key and value checks of one edge; False when the child's key or value is too
        malformed to count or to check further."""
        if child.parent is not node:
            errors.append(f"bad parent link: {where}")
        if not child.key:
            errors.append(f"empty key: {where}")
            return False
        if self._child_key(child.key) != ckey:
            errors.append(f"child dict key {ckey} != first page of key: {where}")
        if len(child.key) % self.page_size:
            errors.append(f"key length {len(child.key)} not page aligned: {where}")
        v = child.value
        if v.dtype != torch.int64 or v.dim() != 1 or v.numel() != len(child.key):
            errors.append(
                f"value dtype={v.dtype} shape={tuple(v.shape)} vs key len "
                f"{len(child.key)}: {where}"
            )
            return False
        return True

    def _slot_errors(self, slots: torch.Tensor) -> list[str]:
        """Ownership checks of every tree slot against itself and the allocator."""
        errors: list[str] = []
        ps = self.page_size
        if torch.unique(slots).numel() != slots.numel():
            errors.append("a slot is owned by two tree positions")
        rows = slots.view(-1, ps)
        pages = torch.div(rows[:, 0], ps, rounding_mode="floor")
        offsets = torch.arange(ps, dtype=torch.int64)
        if not torch.equal(rows, pages[:, None] * ps + offsets[None, :]):
            errors.append("tree values are not whole pages")
        elif int(pages.min()) <= 0 or int(pages.max()) >= self.allocator.num_pages:
            errors.append("tree holds the reserved page 0 or a page outside the pool")
        elif bool(self.allocator.is_free_page(pages).any()):
            errors.append("tree holds pages that the allocator lists as free")
        return errors

    # ------------------------------------------------------------------ internals

    def _tick(self) -> float:
        self._clock += 1
        return float(self._clock)

    def _new_node(
        self, key: list[int], value: torch.Tensor, parent: TreeNode | None, last_access: float
    ) -> TreeNode:
        self._next_node_id += 1
        return TreeNode(self._next_node_id, key, value, parent, last_access)

    def _child_key(self, key: list[int], off: int = 0) -> ChildKey:
        if self.page_size == 1:
            return key[off]
        return tuple(key[off : off + self.page_size])

    def _match_len(self, node_key: list[int], key: list[int], off: int, end: int) -> int:
        """Length of the common prefix of `node_key` and `key[off:end]`, rounded down to pages.
        `end - off` and `len(node_key)` are multiples of page_size."""
        n = min(len(node_key), end - off)
        i = 0
        while i < n and node_key[i] == key[off + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` after `n` tokens (0 < n < len, page aligned); returns the new upper node.

        The new node goes ABOVE `child`, so any request holding `child` as its locked
        `last_node` still holds the deepest node; the upper node inherits `child`'s lock_ref
        (the same locks pass through it) and access time, so sizes and counters are unchanged.
        """
        parent = child.parent
        if parent is None or not 0 < n < len(child.key) or n % self.page_size:
            raise AssertionError(f"bad split of {child!r} at {n}")
        upper = self._new_node(child.key[:n], child.value[:n].clone(), parent, child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[self._child_key(upper.key)] = upper  # replaces `child` (same first page)
        child.key = child.key[n:]
        child.value = child.value[n:].clone()
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises if `node` is detached."""
        path: list[TreeNode] = []
        n = node
        while n is not self._root:
            parent = n.parent
            # A detached node may still point at a live parent (its top node was evicted, or
            # the tree was reset): check membership, not just the parent chain.
            if parent is None or parent.children.get(self._child_key(n.key)) is not n:
                raise RuntimeError(f"{node!r} is not in the tree (evicted or from before reset)")
            path.append(n)
            n = parent
        return path

    def _nodes(self) -> list[TreeNode]:
        """Every non-root node."""
        out: list[TreeNode] = []
        stack = list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def leaves(self, unlocked_only: bool = False) -> list[TreeNode]:
        """Nodes without children (the root aside); `unlocked_only`: those eviction may take."""
        return [n for n in self._nodes()
                if not n.children and (n.lock_ref == 0 or not unlocked_only)]

    def _evict_leaf(self, node: TreeNode) -> int:
        """Free an unlocked leaf's slots and detach it; returns its token count."""
        parent = node.parent
        if parent is None or node.children or node.lock_ref != 0:
            raise AssertionError(f"evicting a node that is not an unlocked leaf: {node!r}")
        ckey = self._child_key(node.key)
        if parent.children.get(ckey) is not node:
            raise AssertionError(f"{node!r} missing from its parent's children")
        self.allocator.free(node.value)  # raises on double free before the tree changes
        del parent.children[ckey]
        n = len(node.key)
        self._evictable -= n
        node.parent = None
        node.value = _EMPTY_SLOTS
        return n

    def _check_insert_args(self, key: list[int], value: torch.Tensor) -> None:
        ps = self.page_size
        if value.dtype != torch.int64 or value.dim() != 1:
            raise ValueError(
                f"insert() value must be a 1-D int64 slot tensor, got dtype={value.dtype} "
                f"shape={tuple(value.shape)}"
            )
        if value.numel() != len(key):
            raise ValueError(f"insert() key length {len(key)} != value length {value.numel()}")
        if len(key) % ps:
            raise ValueError(f"insert() key length {len(key)} is not a multiple of page_size={ps}")
        if value.numel() == 0:
            return
        rows = value.view(-1, ps)
        pages = torch.div(rows[:, 0], ps, rounding_mode="floor")
        offsets = torch.arange(ps, dtype=torch.int64)
        if not torch.equal(rows, pages[:, None] * ps + offsets[None, :]):
            raise ValueError(f"insert() value is not whole pages (page_size={ps})")
        if int(pages.min()) <= 0 or int(pages.max()) >= self.allocator.num_pages:
            raise RuntimeError(
                "insert() value holds the reserved page 0 or a page outside the pool"
            )
