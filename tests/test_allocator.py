"""PageAllocator: whole-page accounting, reserved page 0, loud double frees, determinism."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
import torch

from phaseflip.cache.allocator import PageAllocator


def _slots(*pages: int, page_size: int) -> torch.Tensor:
    return torch.tensor(
        [p * page_size + i for p in pages for i in range(page_size)], dtype=torch.int64
    )


@pytest.mark.parametrize(("num_pages", "page_size"), [(1, 1), (2, 1), (9, 1), (5, 4), (3, 16)])
def test_fresh_pool_counts(num_pages: int, page_size: int) -> None:
    a = PageAllocator(num_pages, page_size)
    assert a.page_size == page_size
    assert a.total_slots == (num_pages - 1) * page_size
    assert a.free_slots == a.total_slots
    assert a.free_pages == num_pages - 1
    assert sorted(a.free_page_ids().tolist()) == list(range(1, num_pages))


@pytest.mark.parametrize("page_size", [1, 4])
def test_never_hands_out_page_zero(page_size: int) -> None:
    a = PageAllocator(6, page_size)
    pages = a.alloc_pages(5)
    assert pages is not None
    assert sorted(pages.tolist()) == [1, 2, 3, 4, 5]
    assert a.free_slots == 0
    assert a.alloc_pages(1) is None


@pytest.mark.parametrize(
    ("num_pages", "first", "second", "second_ok"),
    [
        (5, 2, 2, True),  # exactly exhausts the pool
        (5, 2, 3, False),  # one too many: nothing taken
        (5, 0, 5, False),
        (5, 4, 0, True),  # zero pages always succeeds
    ],
)
def test_alloc_all_or_nothing(num_pages: int, first: int, second: int, second_ok: bool) -> None:
    a = PageAllocator(num_pages, 4)
    p1 = a.alloc_pages(first)
    assert p1 is not None and p1.numel() == first and p1.dtype == torch.int64
    before = a.free_slots
    p2 = a.alloc_pages(second)
    if second_ok:
        assert p2 is not None and p2.numel() == second
        assert a.free_slots == before - second * 4
        assert not set(p1.tolist()) & set(p2.tolist())
    else:
        assert p2 is None
        assert a.free_slots == before


def test_alloc_slots_layout() -> None:
    a = PageAllocator(8, 4)
    s = a.alloc_slots(2)
    assert s is not None and s.dtype == torch.int64
    pages = s.view(-1, 4)[:, 0] // 4
    assert torch.equal(s, _slots(*pages.tolist(), page_size=4))
    assert a.alloc_slots(6) is None
    assert a.free_slots == 5 * 4


def test_free_returns_pages_and_counts() -> None:
    a = PageAllocator(8, 4)
    s = a.alloc_slots(3)
    assert s is not None
    a.free(s[4:8])
    assert a.free_slots == 5 * 4
    a.free(torch.cat([s[8:12], s[0:4]]))  # any order of whole pages
    assert a.free_slots == a.total_slots
    a.free(torch.empty(0, dtype=torch.int64))  # no-op
    assert a.free_slots == a.total_slots


@pytest.mark.parametrize(
    ("page_size", "make_bad", "exc"),
    [
        # partial page
        (4, lambda s: s[:3], ValueError),
        # right length but not starting at a page boundary
        (4, lambda s: s[1:5], ValueError),
        # whole length but slots of a page out of order
        (4, lambda s: s[:4].flip(0), ValueError),
        # same page twice in one call
        (4, lambda s: torch.cat([s[:4], s[:4]]), RuntimeError),
        # reserved page 0
        (4, lambda s: torch.arange(4, dtype=torch.int64), RuntimeError),
        (1, lambda s: torch.tensor([0], dtype=torch.int64), RuntimeError),
        # outside the pool
        (4, lambda s: torch.arange(400, 404, dtype=torch.int64), RuntimeError),
        (1, lambda s: torch.tensor([-1], dtype=torch.int64), RuntimeError),
        # wrong dtype / rank
        (4, lambda s: s[:4].to(torch.int32), ValueError),
        (4, lambda s: s[:8].view(2, 4), ValueError),
    ],
)
def test_free_rejects_bad_input_and_frees_nothing(
    page_size: int,
    make_bad: Callable[[torch.Tensor], torch.Tensor],
    exc: type[Exception],
) -> None:
    a = PageAllocator(6, page_size)
    s = a.alloc_slots(3)
    assert s is not None
    before = a.free_page_ids()
    with pytest.raises(exc):
        a.free(make_bad(s))
    assert torch.equal(a.free_page_ids(), before)


@pytest.mark.parametrize("page_size", [1, 4])
def test_double_free_raises(page_size: int) -> None:
    a = PageAllocator(6, page_size)
    s = a.alloc_slots(2)
    assert s is not None
    a.free(s[:page_size])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s[:page_size])
    # a mixed call (one live page, one already free) frees nothing
    with pytest.raises(RuntimeError, match="double free"):
        a.free(s)
    assert a.free_slots == a.total_slots - page_size
    a.free(s[page_size:])
    assert a.free_slots == a.total_slots


def test_free_never_allocated_page_raises() -> None:
    a = PageAllocator(6, 2)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(_slots(3, page_size=2))


def _run_sequence(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    a = PageAllocator(40, 4)
    held: list[torch.Tensor] = []
    trace: list[list[int]] = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            a.free(held.pop(rng.randrange(len(held))))
        else:
            s = a.alloc_slots(rng.randint(0, 6))
            trace.append([] if s is None else s.tolist())
            if s is not None and s.numel():
                held.append(s)
        live = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        free = a.pages_to_slots(a.free_page_ids())
        # partition: every usable slot is held or free, exactly once
        assert torch.equal(torch.cat([live, free]).sort().values, torch.arange(4, 40 * 4))
        assert a.free_slots + live.numel() == a.total_slots
    return trace


def test_deterministic_and_partitioned() -> None:
    assert _run_sequence(1) == _run_sequence(1)
    assert _run_sequence(1) != _run_sequence(2)


def test_reset_frees_everything() -> None:
    a = PageAllocator(10, 2)
    first = a.alloc_slots(4)
    a.alloc_slots(3)
    a.reset()
    assert a.free_slots == a.total_slots
    again = a.alloc_slots(4)
    assert first is not None and again is not None and torch.equal(first, again)


def test_large_alloc_is_vectorized() -> None:
    a = PageAllocator(200_001, 16)
    t0 = time.perf_counter()
    s = a.alloc_slots(200_000)
    assert s is not None and s.numel() == 3_200_000
    a.free(s)
    assert a.free_slots == a.total_slots
    assert time.perf_counter() - t0 < 2.0
