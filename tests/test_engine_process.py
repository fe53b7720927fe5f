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


def test_a_slow_step_is_logged_and_can_dump_its_stack(llama_dir, make_engine, monkeypatch,
                                                      caplog, capfd):
    """A step that stalls every stream (an FP8 server's ~1.8 s stall had no log line) is
    logged with what it held, and with the trace knob its Python stack is dumped mid-step."""
    import logging
    import time

    from phaseflip.sampling.params import SamplingParams
    from phaseflip.server import engine_process as ep

    engine = make_engine(llama_dir)
    server = ep.EngineServer.__new__(ep.EngineServer)
    server.core, server.send, server.trace_after_s = engine.core, lambda msg: None, 0.05
    server.busy_s = 0.0
    engine.core.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2, ignore_eos=True))
    step = engine.core.step

    def slow_step(**kw):
        time.sleep(0.3)
        return step(**kw)

    monkeypatch.setattr(engine.core, "step", slow_step)
    monkeypatch.setattr(ep, "SLOW_STEP_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="phaseflip.engine"):
        server._timed_step()
    assert any("slow step" in r.getMessage() and "3 prompt tokens" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert "slow_step" in capfd.readouterr().err  # the stack dumped while it slept
    assert server.busy_s >= 0.3  # the step's wall time counts as busy
    monkeypatch.undo()
    while engine.core.has_work():
        engine.core.step()
