"""Grammars compile off the engine loop (issue 20): a new schema never pauses decoding.

Every test makes the grammar build slow (`_build` sleeps `SLOW_S`; both the tokenizer-free
check and the compile call it) and drives `EngineCore` step by step on the CPU: running
requests keep their one token a step while the constrained one waits, unadmitted, for its
compile; its output is that of the cached (synchronous) path; a grammar that fails is the
error the client got before; abort and shutdown with a compile in flight leave nothing
behind and do not wait for it."""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import pytest

import phaseflip
from phaseflip import SamplingParams
from phaseflip.errors import InvalidRequestError
from phaseflip.sampling import grammar as grammar_mod
from phaseflip.sampling.grammar import GrammarSpec

EMBEDDED = Path(phaseflip.__file__).parent / "assets" / "tiny-llama"
NESTED = Path(__file__).parents[1] / "benchmarks" / "schemas" / "nested.json"
SLOW_S = 0.5  # each build of a grammar (check, compile) sleeps this long
DEADLINE_S = 180.0  # any loop below that runs longer fails (a hang, not a timing: 12 s alone,
# over 60 s once on the 2-core CI box under both workers)
GATE_S = 20.0  # a gated build gives up after this long


def _new_schema() -> GrammarSpec:
    """The nested schema under a fresh title: no cache of this process has seen it."""
    schema = json.loads(NESTED.read_text()) | {"title": f"Step{uuid.uuid4().hex[:8]}"}
    return GrammarSpec.json_schema(schema)


@pytest.fixture
def slow_build(monkeypatch) -> list[str]:
    """Every grammar build sleeps SLOW_S; yields the names of the threads that built."""
    threads: list[str] = []
    build = grammar_mod._build

    def slow(spec):
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_S)
        return build(spec)

    monkeypatch.setattr(grammar_mod, "_build", slow)
    return threads


@pytest.fixture
def gated_build(monkeypatch):
    """Every grammar build waits for the gate (an Event the test opens); yields the gate and the
    names of the threads that built. A build on the engine loop would hold the loop until the
    gate times out (GATE_S) and then fail the request: no wall-time threshold decides."""
    gate = threading.Event()
    threads: list[str] = []
    build = grammar_mod._build

    def gated(spec):
        threads.append(threading.current_thread().name)
        if not gate.wait(GATE_S):
            raise RuntimeError("the test never opened the gate")
        return build(spec)

    monkeypatch.setattr(grammar_mod, "_build", gated)
    yield gate, threads
    gate.set()


def _prompt(i: int) -> list[int]:
    return [(11 * i + j) % 4000 + 5 for j in range(24)]


def _run_until(core, done, on_step=None) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the engine did not get there in time"
        t0 = time.perf_counter()
        core.step()
        if on_step is not None:
            on_step(time.perf_counter() - t0)


def test_a_new_schema_does_not_pause_running_requests(make_engine, gated_build) -> None:
    """Red before issue 20's change: add_request built (check) and compiled the grammar on
    the loop, so no running request got a token until the build was done. Here the build
    waits for a gate the test opens only after three steps: the steps can run only if the
    build is off the loop (on it, add_request would wait out GATE_S and the build fail)."""
    gate, build_threads = gated_build
    engine = make_engine(EMBEDDED, overlap_schedule=False)
    core = engine.core
    plain = SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True)
    for i in range(4):
        core.add_request(f"p{i}", _prompt(i), plain)
    sched = core.scheduler
    _run_until(core, lambda: len(sched.running) == 4
               and all(len(r.output_ids) >= 2 for r in sched.running))
    running = list(sched.running)
    spec = _new_schema()
    constrained = SamplingParams(temperature=0, max_new_tokens=384, grammar=spec)
    core.add_request("g", _prompt(9), constrained)
    (req,) = core.groups["g"].reqs
    assert req.compiling and req in sched.waiting

    lengths = [len(r.output_ids) for r in running]
    for _ in range(3):  # the gate is shut: the build cannot finish during these steps
        core.step()
        now = [len(r.output_ids) for r in running]
        assert now == [n + 1 for n in lengths], (lengths, now)  # every running request
        assert req.compiling and req not in sched.running and req.kv_len == 0
        lengths = now
    assert not gate.is_set()
    gate.set()
    deadline = time.monotonic() + DEADLINE_S
    while req.compiling:
        assert time.monotonic() < deadline
        core.step()
    assert build_threads and all(n.startswith("phaseflip-grammar") for n in build_threads)
    _run_until(core, lambda: not core.has_work())
    async_ids = req.output_ids
    assert req.finish_reason == "stop", req.finish_reason
    json.loads(core.tokenizer.decode(async_ids, skip_special_tokens=True))
    # the cached path (synchronous, as before the change): the same greedy tokens
    book = core.sampling.grammars
    assert book.compiles == 1
    core.add_request("g2", _prompt(9), constrained)
    (again,) = core.groups["g2"].reqs
    assert not again.compiling  # a hit: its matcher at once
    _run_until(core, lambda: again.finished)
    assert again.output_ids == async_ids and book.compiles == 1


def test_a_grammar_that_fails_off_the_loop_is_the_clients_400(make_engine) -> None:
    """A grammar the front end did not check (it does: this is the engine's own guard) fails
    on the compile thread: its request ends, never admitted, with the error `check` gives,
    told once per request (n = 2 samples) before its deltas."""
    engine = make_engine(EMBEDDED)
    core = engine.core
    told: list[tuple[str, InvalidRequestError]] = []
    core.request_failed = lambda rid, e: told.append((rid, e))
    bad = GrammarSpec("json_schema", json.dumps({"type": "strin", "title": uuid.uuid4().hex}))
    with pytest.raises(InvalidRequestError) as expected:
        GrammarSpec(bad.kind, bad.value + " ").check()  # the same problem, its own cache entry
    core.add_request("ok", _prompt(1), SamplingParams(temperature=0, max_new_tokens=8))
    core.add_request("bad", _prompt(2), SamplingParams(n=2, max_new_tokens=8, grammar=bad))
    deltas = []
    deadline = time.monotonic() + DEADLINE_S
    while core.has_work():
        assert time.monotonic() < deadline
        deltas += core.step()
    assert [(rid, str(e), e.param) for rid, e in told] == [
        ("bad", str(expected.value), "response_format")]
    assert "strin" in str(told[0][1])
    ends = [(d.index, d.finish_reason) for d in deltas if d.request_id == "bad"]
    assert sorted(ends) == [(0, "abort"), (1, "abort")]
    assert core.scheduler.stats.prefill_tokens == len(_prompt(1))  # "bad" never reached it
    assert core.sampling.grammars.compiling == 0


def test_abort_while_compiling_leaves_nothing(make_engine, slow_build) -> None:
    engine = make_engine(EMBEDDED)
    core = engine.core
    book = core.sampling.grammars
    core.add_request("g", _prompt(3), SamplingParams(max_new_tokens=8, grammar=_new_schema()))
    (req,) = core.groups["g"].reqs
    core.step()
    assert req.compiling and book.compiling == 1
    deltas = core.abort("g")
    assert [d.finish_reason for d in deltas] == ["abort"]
    assert "g" not in core.groups and not core.scheduler.waiting and not core.has_work()
    deadline = time.monotonic() + DEADLINE_S
    while book._inflight:  # its trial is stopped (killed, or left starting): nothing compiled
        assert time.monotonic() < deadline
        book.poll(0.05)
    assert book.compiling == 0 and not book.tracked(req) and book.compiles == 0
    acc = core.check_pool()
    assert acc.balanced and acc.private == 0 and acc.protected == 0, acc


def test_shutdown_with_a_compile_in_flight_does_not_wait_for_it(monkeypatch) -> None:
    """Engine.shutdown returns at once; the compile ends on its own thread, unread."""
    build = grammar_mod._build
    never = threading.Event()  # the compile outlasts the 10 s the shutdown is given
    monkeypatch.setattr(grammar_mod, "_build", lambda spec: (never.wait(GATE_S),
                                                             build(spec))[1])
    engine = phaseflip.Engine(str(EMBEDDED), device="cpu", dtype="float32",
                              max_total_tokens=4096)
    core = engine.core
    for i in range(3):  # more compiles than threads: one is queued, and cancelled
        core.add_request(f"g{i}", _prompt(i),
                         SamplingParams(max_new_tokens=8, grammar=_new_schema()))
    core.step()
    done = threading.Event()
    stopper = threading.Thread(target=lambda: (engine.shutdown(), done.set()), daemon=True)
    stopper.start()
    try:
        assert done.wait(10.0), "Engine.shutdown hung on a compile in flight"
    finally:
        never.set()


def test_an_idle_engine_waits_for_the_compile_rather_than_spin(make_engine, slow_build) -> None:
    """With nothing else to run, a step waits (up to GRAMMAR_WAIT_S) for the compile: a few
    steps per compile, not one every few microseconds."""
    from phaseflip.engine.core import GRAMMAR_WAIT_S

    engine = make_engine(EMBEDDED)
    core = engine.core
    core.add_request("g", _prompt(5), SamplingParams(max_new_tokens=4, grammar=_new_schema()))
    (req,) = core.groups["g"].reqs
    steps, t0, deadline = 0, time.perf_counter(), time.monotonic() + DEADLINE_S
    while req.compiling:
        assert time.monotonic() < deadline
        core.step()
        steps += 1
    waited_s = time.perf_counter() - t0
    assert waited_s >= SLOW_S and steps <= waited_s / GRAMMAR_WAIT_S + 3, (steps, waited_s)
    _run_until(core, lambda: not core.has_work())
    assert req.finished
