"""The engine process's own reports."""

from __future__ import annotations

from phaseflip.server.engine_process import pool_accounting


def test_pool_report_counts_slots_of_loads_in_flight(llama_dir, make_engine, monkeypatch):
    """A HiCache load in flight holds slots that are neither free, in the tree nor any
    request's: the report between steps must count them (it said 'balanced: false' on every
    flip and some idle polls while loads were in flight)."""
    engine = make_engine(llama_dir, enable_hicache=True, hicache_page_size=8)
    core = engine.core
    held = core.kv.allocator.alloc_slots(16)  # page size 1: what a COPYING LoadJob holds
    monkeypatch.setattr(type(core.hicache), "in_flight_slots", property(lambda _: 16))
    acc = pool_accounting(core)
    assert acc.withheld == 16 and acc.balanced
    monkeypatch.undo()
    core.kv.allocator.free(held)
    assert pool_accounting(core).balanced
