"""Page allocator for the KV slot space.

Slot `s` is row `s` of every layer's K/V buffer (see `kv_pool.py`). Slots are grouped in pages of
`page_size` consecutive slots: page `p` owns slots `[p * page_size, (p + 1) * page_size)`. The
allocator hands out and takes back whole pages only, so a page is always wholly free, wholly in
the prefix tree, or wholly held by one request; nothing ever needs to track partial pages.

Page 0 is reserved: it is never handed out, so slot 0 can be the write target of padded tokens
without clobbering anybody's KV.

Ownership: a page returned by `alloc_pages`/`alloc_slots` belongs to the caller until it passes
the page's slots back to `free` (directly, or by handing them to the radix cache, which frees
them on eviction). The allocator checks every `free` (whole pages, not page 0, not already free),
because a double free here would silently give one KV row to two sequences.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """Deterministic LIFO free list of page ids, kept in one int64 tensor.

    Invariants:
      * `_stack[:_num_free]` holds exactly the free page ids, each once; page 0 is never there.
      * `_is_free[p]` is True iff page `p` is in `_stack[:_num_free]`; `_is_free[0]` is False.
    Allocation pops from the top of the stack and freeing pushes onto it, so the same call
    sequence always yields the same pages. After construction or `reset` pages come out lowest
    id first (1, 2, 3, ...), which keeps fresh-pool slot numbers easy to read in tests and logs.

    The scheduler allocates a page for every decoding request every step (256 calls a step at
    full batch), so allocation works on numpy views of the two tensors: a numpy scalar read or
    write costs ~0.1 us, a torch one 1-3 us. The views share the tensors' memory; both are
    only ever updated in place.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._stack = torch.empty(num_pages - 1, dtype=torch.int64)
        self._is_free = torch.zeros(num_pages, dtype=torch.bool)
        self._num_free = 0
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self._stack_np = self._stack.numpy()
        self._is_free_np = self._is_free.numpy()
        self.reset()

    @property
    def total_slots(self) -> int:
        """Usable slots: every page except the reserved page 0."""
        return (self.num_pages - 1) * self.page_size

    @property
    def free_slots(self) -> int:
        return self._num_free * self.page_size

    @property
    def free_pages(self) -> int:
        return self._num_free

    def alloc_pages(self, n: int) -> torch.Tensor | None:
        """Take `n` free pages; returns their ids (int64 [n]) or None, allocating nothing,
        if fewer than `n` are free. The caller owns the returned pages until it frees them."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > self._num_free:
            return None
        top = self._num_free
        # Top of the stack is the end of the live prefix; flip so the most recently pushed page
        # (the lowest id on a fresh pool) comes first.
        pages = self._stack_np[top - n : top][::-1].copy()
        self._num_free = top - n
        self._is_free_np[pages] = False
        return torch.from_numpy(pages)

    def alloc_page(self) -> int | None:
        """One free page id (what `alloc_pages(1)` would return), or None if none is free:
        the decode step's allocation, without making a tensor."""
        top = self._num_free
        if top == 0:
            return None
        page = int(self._stack_np[top - 1])
        self._num_free = top - 1
        self._is_free_np[page] = False
        return page

    def alloc_slots(self, n_pages: int) -> torch.Tensor | None:
        """The slots (int64 [n_pages * page_size]) of `n_pages` fresh pages, page by page in
        ascending slot order within each page; None if not enough pages are free."""
        pages = self.alloc_pages(n_pages)
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """All slots of `pages`, page by page."""
        return (pages[:, None] * self.page_size + self._page_offsets[None, :]).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Return the pages that `slots` covers to the free list.

        `slots` must be a union of whole pages: its length a multiple of `page_size`, each run of
        `page_size` entries the consecutive slots of one page starting at its boundary (pages in
        any order). Raises ValueError for a malformed tensor and RuntimeError for page 0, an
        already-free page or a page given twice; on any error nothing is freed.
        """
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise ValueError(
                f"free() wants a 1-D int64 slot tensor, got dtype={slots.dtype} "
                f"shape={tuple(slots.shape)}"
            )
        if slots.numel() == 0:
            return
        ps = self.page_size
        if slots.numel() % ps != 0:
            raise ValueError(f"free() of {slots.numel()} slots: not a multiple of page_size={ps}")
        rows = slots.view(-1, ps)
        pages = torch.div(rows[:, 0], ps, rounding_mode="floor")
        if not torch.equal(rows, pages[:, None] * ps + self._page_offsets[None, :]):
            raise ValueError(
                f"free() of slots that are not whole pages (page_size={ps}): {slots.tolist()[:64]}"
            )
        if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
            raise RuntimeError(
                f"free() of pages outside the pool [0, {self.num_pages}): {pages.tolist()[:64]}"
            )
        if bool((pages == 0).any()):
            raise RuntimeError("free() of reserved page 0 (padding page is never allocated)")
        if pages.numel() > 1 and torch.unique(pages).numel() != pages.numel():
            raise RuntimeError(f"free() lists a page twice: {pages.tolist()[:64]}")
        already = self._is_free[pages]
        if bool(already.any()):
            raise RuntimeError(f"double free of pages {pages[already].tolist()[:64]}")
        n = pages.numel()
        top = self._num_free
        # Push in reverse so that a subsequent alloc of the same size returns them in this order.
        self._stack[top : top + n] = pages.flip(0)
        self._num_free = top + n
        self._is_free[pages] = True

    def free_page_ids(self) -> torch.Tensor:
        """A copy of the free page ids (debugging and accounting checks, not the hot path)."""
        return self._stack[: self._num_free].clone()

    def is_free_page(self, pages: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each of `pages` is currently free."""
        return self._is_free[pages]

    def reset(self) -> None:
        """Mark every page except page 0 free. Whatever anyone held is forgotten: only call this
        when nothing references the slot space (engine start, or after the cache was emptied)."""
        n = self.num_pages - 1
        # Stack bottom = highest id, top = page 1, so a fresh pool hands out 1, 2, 3, ...
        self._stack[:] = torch.arange(self.num_pages - 1, 0, -1, dtype=torch.int64)
        self._num_free = n
        self._is_free.fill_(True)
        self._is_free[0] = False
