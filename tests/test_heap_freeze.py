"""`freeze_heap`: the cyclic collector's full passes stop walking what was alive at build,
and an engine's end makes it collectable again (engines built one after another in a process
must not keep each other's cycles, and with them device memory)."""

from __future__ import annotations

import gc
import weakref

import pytest

from phaseflip.heap import collector_paused, freeze_heap, thaw_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def thawed():
    thaw_heap()
    yield
    thaw_heap()


def test_frozen_cycles_wait_for_the_thaw(thawed):
    node = _Node()
    ref = weakref.ref(node)
    freeze_heap()
    assert gc.get_freeze_count() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: a full pass does not see it
    thaw_heap()
    gc.collect()
    assert ref() is None


def test_closing_an_engine_thaws_the_heap(thawed):
    from phaseflip import Engine

    engine = Engine(None, device="cpu", dtype="float32", max_total_tokens=4096)
    freeze_heap()  # as a GPU engine's build does
    engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_a_dropped_engine_is_freed_with_the_heap_frozen(thawed):
    """An engine dropped without `shutdown` goes when its last reference does, frozen or not:
    nothing of it sits in a reference cycle, which a frozen heap would keep for good (with its
    weights, pool and graphs on a GPU). Red while the core holds the engine's bound method."""
    from phaseflip import Engine

    engine = Engine(None, device="cpu", dtype="float32", max_total_tokens=4096)
    engine.generate([[5, 6, 7]], use_tqdm=False)
    freeze_heap()  # as a GPU engine's build does (everything alive now is frozen)
    core = weakref.ref(engine.core)
    del engine
    assert core() is None


def test_full_passes_come_rarer_while_frozen(thawed):
    """Frozen, a full pass still walks everything the run made since (~26 ms a pass at a
    thousand live requests on the step loop): the heap freeze also spaces them out, and the
    thaw restores Python's pace."""
    assert gc.get_threshold()[2] == 10
    freeze_heap()
    assert gc.get_threshold()[2] == 1000
    thaw_heap()
    assert gc.get_threshold()[2] == 10


def test_no_collector_pass_frees_a_cycle_inside_a_capture_pause(thawed):
    """A CUDA graph left in a reference cycle must not be destroyed while another is being
    captured (`collector_paused` around every capture): with passes due every 10 allocations,
    a cycle dropped inside the block survives it and is freed after. Red with the pause a
    no-op."""
    old = gc.get_threshold()
    gc.set_threshold(10, 1, 1)
    try:
        node = _Node()
        gone = weakref.ref(node)
        with collector_paused():
            del node
            junk = [[_Node()] for _ in range(10_000)]  # many passes' worth of allocations
            assert gone() is not None
        del junk
        gc.collect()
        assert gone() is None
    finally:
        gc.set_threshold(*old)


def test_the_pause_restores_the_collector_as_it_found_it():
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        assert not gc.isenabled()
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause is left alone
    finally:
        gc.enable()
