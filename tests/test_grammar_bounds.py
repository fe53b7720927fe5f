"""Bounds on what one request may cost the server: a grammar's build and compile (tried in a
child process that is killed past a budget, when its request is aborted, or with its parent),
and a chat body's messages (bounded before any is checked, so the event loop stays free).

Grammars here are ones xgrammar takes minutes over on one core: 2 600 optional integer
properties (62 KB of schema, compile-bound) and a `pattern` with a repetition bound of 30 000
(43 characters, build-bound, growing with the bound's square). Each test only waits out a
budget of a few seconds: the children are killed, never waited for."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import os
import signal
import string
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import phaseflip
from phaseflip import SamplingParams
from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import GrammarBook, GrammarSpec
from phaseflip.sampling.grammar_worker import GrammarProbes, GrammarTooComplexError
from phaseflip.server import protocol as p
from phaseflip.server.protocol import requests as request_models
from tests.fake_engine import fake_server, tokenizer
from tests.test_server_ops import asgi

EMBEDDED = Path(phaseflip.__file__).parent / "assets" / "tiny-llama"
BUDGET_S = 4.0  # the book's budget here; every grammar below takes minutes
DEADLINE_S = 60.0  # a loop that runs longer fails (a hang, not a timing)
NAMES = ["".join(t) for n in (1, 2) for t in itertools.product(string.ascii_letters, repeat=n)]
SLOW_COMPILE = GrammarSpec("json_schema", json.dumps(
    {"type": "object", "properties": {k: {"type": "integer"} for k in NAMES[:2600]}},
    separators=(",", ":")))
SLOW_BUILD = GrammarSpec.json_schema({"type": "string", "pattern": "[a-z]{0,30000}"})
SMALL = GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}},
                                 "required": ["n"]})


def _gone(pid: int, within_s: float) -> bool:
    """Whether process `pid` has ended (or is a zombie nobody reaped yet) within `within_s`."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def engine():
    """The embedded model on the CPU, its grammar book given a BUDGET_S budget, its trial
    child started by a small grammar."""
    e = phaseflip.Engine(str(EMBEDDED), device="cpu", dtype="float32", max_total_tokens=4096)
    core = e.core
    core.sampling.grammars = GrammarBook(core.tokenizer, core.model_cfg.vocab_size,
                                         budget_s=BUDGET_S)
    core.sampling.grammars.compiled(SMALL)
    yield e
    pids = core.sampling.grammars.trial_pids
    e.shutdown()
    assert all(_gone(pid, 5.0) for pid in pids), "a trial child outlived its engine"


def _steps_until(core, done) -> list:
    deltas, end = [], time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < end, "the engine did not get there in time"
        deltas += core.step()
    return deltas


def test_a_grammar_past_the_budget_is_a_400_and_its_trial_is_killed(engine) -> None:
    """Red before: the compile ran on a compile thread to its end (minutes), its client
    waiting; nothing could stop it. Now its trial is killed at the budget and the request
    ends with the 400 its client gets; the next grammar compiles in a new child."""
    core, book = engine.core, engine.core.sampling.grammars
    told: list[InvalidRequestError] = []
    core.request_failed = lambda _rid, e: told.append(e)
    compiles, t0 = book.compiles, time.monotonic()
    core.add_request("slow", [5, 6, 7], SamplingParams(max_new_tokens=4, grammar=SLOW_COMPILE))
    pids = _trial_running(core, book)
    deltas = _steps_until(core, lambda: told)
    took = time.monotonic() - t0
    assert isinstance(told[0], GrammarTooComplexError), told
    assert f"too complex to compile within {BUDGET_S:g} s" in str(told[0])
    assert told[0].param == "response_format" and took < BUDGET_S + 20, took
    assert [d.finish_reason for d in deltas if d.request_id == "slow"] == ["abort"]
    assert all(_gone(pid, 5.0) for pid in pids) and book.compiles == compiles
    core.request_failed = None
    core.add_request("ok", [5, 6], SamplingParams(max_new_tokens=8, grammar=GrammarSpec(
        "regex", "[0-9]{3}")))
    _steps_until(core, lambda: not core.has_work())
    assert book.compiles == compiles + 1


def _trial_running(core, book) -> list[int]:
    """The trial children's pids once the last added grammar's trial has surely begun."""
    _steps_until(core, lambda: book.compiling and book.trial_pids)
    time.sleep(0.5)  # (its child was ready: the trial is under way)
    return book.trial_pids


def test_abort_kills_the_trial_of_a_grammar_nobody_waits_for(engine) -> None:
    """Red before: an aborted request's compile held its thread to the end (the engine kept
    its result, unused). Now the child trying it is killed within a poll interval of the
    abort, long before the budget, and nothing is compiled."""
    core, book = engine.core, engine.core.sampling.grammars
    compiles = book.compiles
    core.add_request("gone", [5, 6, 7], SamplingParams(max_new_tokens=4, grammar=SLOW_COMPILE))
    pids = _trial_running(core, book)
    t0 = time.monotonic()
    assert [d.finish_reason for d in core.abort("gone")] == ["abort"]
    assert all(_gone(pid, BUDGET_S / 2) for pid in pids), "the trial outlived its request"
    killed_s = time.monotonic() - t0
    assert killed_s < BUDGET_S / 2, killed_s
    _steps_until(core, lambda: not book._inflight and not core.has_work())
    assert book.compiles == compiles and book.compiling == 0


def test_json_object_compiles_in_thread_without_a_child() -> None:
    """`json_object`'s grammar is fixed (no client can make it slow): no trial, no child."""
    book = GrammarBook(tokenizer(), len(tokenizer()))
    try:
        assert book.compiled(GrammarSpec("json_object")) is not None
        assert book.trial_pids == [] and book.compiles == 1
    finally:
        book.close()


@pytest.fixture(scope="module")
def probes():
    """Build-only trial children, as the front end's check uses them."""
    probes = GrammarProbes(budget_s=2.0, processes=1)
    yield probes
    pids = probes.pids
    probes.close()
    assert all(_gone(pid, 5.0) for pid in pids)


def _in_thread(fn, timeout_s: float):
    """`fn()`'s result or exception, or a failure after `timeout_s` (a build in this process
    cannot be stopped: the thread is left to end on its own)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert out, f"still running after {timeout_s} s"
    return out[0]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 — the test looks at which
        return e


def test_the_check_builds_a_grammar_in_a_child_within_its_budget(probes) -> None:
    """Red before: the front end's check built the grammar in its tokenizer pool (43
    characters of schema: minutes), a thread per such request. With probes it is a 400 at
    the budget; a good grammar passes and a bad one is the same 400 as before."""
    t0 = time.monotonic()
    error = _in_thread(lambda: SLOW_BUILD.check("response_format", probes), 30.0)
    assert isinstance(error, GrammarTooComplexError), error
    assert "too complex to compile within 2 s" in str(error) and time.monotonic() - t0 < 20
    assert _in_thread(lambda: SMALL.check("response_format", probes), 30.0) is None
    bad = GrammarSpec("json_schema", json.dumps({"type": "strin"}))
    error = _in_thread(lambda: bad.check("response_format", probes), 30.0)
    with pytest.raises(InvalidRequestError) as expected:
        GrammarSpec(bad.kind, bad.value + " ").check()  # in this process: its own cache entry
    assert str(error) == str(expected.value) and "strin" in str(error)


ORPHAN = textwrap.dedent("""
    import sys, threading, time
    from phaseflip.sampling.grammar import GrammarSpec
    from phaseflip.sampling.grammar_worker import GrammarProbes
    probes = GrammarProbes(budget_s=600.0, processes=1)
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "[a-z]{0,30000}"})
    threading.Thread(target=probes.problem, args=(spec,), daemon=True).start()
    while not probes.pids:
        time.sleep(0.01)
    print(probes.pids[0], flush=True)
    time.sleep(600)
""")


def test_a_trial_child_dies_with_its_process() -> None:
    """A process killed outright (SIGKILL: no clean-up runs) takes its trial child with it,
    even one inside a build that never returns to Python (Linux's parent-death signal)."""
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(EMBEDDED.parents[2])})
    try:
        child = int(proc.stdout.readline())
        time.sleep(5.0)  # (started: importing xgrammar, then the build)
        assert not _gone(child, 0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert _gone(child, 5.0), "the trial child outlived its parent"


# ------------------------------------------------------------------ chat messages


def _chat(n: int, content: object = "hi") -> dict:
    return {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user",
                                                            "content": content}] * n}


async def _health_lag(c, stop: asyncio.Event, lags: list[float]) -> None:
    """/health every 10 ms, recording how late each answer came against when it was due."""
    due = time.perf_counter()
    while not stop.is_set():
        assert (await c.get("/health")).status_code == 200
        lags.append(time.perf_counter() - due)
        due = time.perf_counter() + 0.01
        await asyncio.sleep(0.01)


def test_a_huge_chat_body_is_refused_before_its_messages_are_checked(tmp_path) -> None:
    """Red before: 200 000 one-word messages (7 MB) were each checked by a model on the
    event loop (3 s: /health waited as long) before the context check refused them. Now
    more than MAX_MESSAGES is a 400 naming `messages` and the bound, after the body's
    parse alone (0.1 s here)."""
    body = json.dumps(_chat(200_000)).encode()

    async def go():
        async with fake_server(tmp_path) as (_, app, engine), asgi(app) as c:
            stop, lags = asyncio.Event(), []
            probe = asyncio.create_task(_health_lag(c, stop, lags))
            await asyncio.sleep(0.1)
            r = await c.post("/v1/chat/completions", content=body,
                             headers={"content-type": "application/json"}, timeout=60)
            await asyncio.sleep(0.1)
            stop.set()
            await probe
            return r, max(lags), engine.added

    # the heap frozen as the real front end's is while it serves (`collector_watched`): the
    # body's ~600 000 objects once set off a full collector pass over this worker's whole
    # heap (/health waited 1.27 s in a CI run); the bound tells 3 s from 0.1 s either way
    gc.freeze()
    try:
        r, lag, added = asyncio.run(go())
    finally:
        gc.unfreeze()
    assert lag < 1.5, f"/health waited {lag:.2f} s"
    assert r.status_code == 400 and not added, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and str(p.MAX_MESSAGES) in error["message"], error


def test_the_bounds_on_messages_and_content_parts() -> None:
    """MAX_MESSAGES messages are served; one more, or as many content parts in all, are a
    400 naming `messages` (chat, /tokenize)."""
    assert len(p.ChatCompletionRequest.model_validate(_chat(p.MAX_MESSAGES)).messages) == (
        p.MAX_MESSAGES)
    parts = [{"type": "text", "text": "a"}] * (p.MAX_MESSAGES // 2 + 1)
    for model, body in ((p.ChatCompletionRequest, _chat(p.MAX_MESSAGES + 1)),
                        (p.ChatCompletionRequest, _chat(2, parts)),
                        (p.TokenizeRequest, {"messages": _chat(p.MAX_MESSAGES + 1)["messages"]})):
        with pytest.raises(Exception, match="at most") as e:
            model.model_validate(body)
        message, param = p.validation_error_to_openai(e.value.errors())
        assert param == "messages" and str(p.MAX_MESSAGES) in message, message


def test_a_message_is_checked_without_json_or_type_introspection(monkeypatch) -> None:
    """Red before: each message's lone-surrogate check wrote it as JSON (5 us), and each
    null in it (a replayed assistant turn has five) looked up its field's type (24 us). Text
    and nulls are now encoded as they are, and the nullable fields are known per class."""
    calls = {"dumps": 0, "allows_none": 0}
    dumps, allows_none = json.dumps, request_models._allows_none

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    monkeypatch.setattr(request_models.json, "dumps", counted("dumps", dumps))
    monkeypatch.setattr(request_models, "_allows_none", counted("allows_none", allows_none))
    replayed = {"role": "assistant", "content": "héllo", "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": None}
    body = {"model": "tiny", "messages": [replayed, {"role": "user", "content": [
        {"type": "text", "text": "hi"}]}] * 500}
    p.ChatCompletionRequest.model_validate(body)
    # (the body; list parts; a few more when another thread of the test process writes JSON
    # while `json.dumps` is patched: 502 once in CI. Per message it would be 1 000+)
    assert calls["dumps"] <= 510 and calls["allows_none"] == 0, calls
    with pytest.raises(Exception, match="lone surrogate"):
        p.ChatCompletionRequest.model_validate({"model": "tiny", "messages": [
            replayed | {"content": "ok"}, replayed | {"content": "\ud800"}]})
