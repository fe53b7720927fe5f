"""A client that disconnects aborts its request and frees its KV: `/v1/responses` and the native
`/generate`, streamed or not, one prompt or several (and `n` > 1), alone and among a hundred
concurrent streams, against a real `phaseflip serve` (embedded model, CPU, accounting checks
on). Every wait has a deadline, so a request that is never aborted fails the test instead of
hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import pytest

from phaseflip.distributed.spawner import child_pids
from tests.server_process import start_server, stop_server

MODEL = "tiny-llama"
LONG = 900  # new tokens no test waits for: a request that is not aborted keeps the engine busy
LONG_PARAMS = {"max_new_tokens": LONG, "ignore_eos": True}


@pytest.fixture(scope="module")
def served():
    """A `phaseflip serve` of this module alone (it must exit cleanly): (process, url)."""
    proc, url = start_server()
    yield proc, url
    stop_server(proc)
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def server(served) -> str:
    return served[1]


@contextmanager
def engine_paused(server_pid: int):
    """The engine process stopped (SIGSTOP) inside the block: the front end goes on, and what
    it sends the engine waits, as during a long step; resumed however the block ends."""
    (pid,) = [p for p in child_pids(server_pid)  # (not multiprocessing's resource tracker)
              if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes()]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def info(url: str) -> dict:
    return httpx.get(url + "/server_info", timeout=5).json()


def decoded(url: str) -> int:
    """Tokens the engine decoded since it started."""
    return info(url)["scheduler"]["decode_tokens"]


def idle(url: str, deadline_s: float = 3.0) -> dict:
    """/server_info once nothing runs or waits, with the pool balanced and no KV held by a
    request; fails if that takes longer than `deadline_s` (a request was not aborted)."""
    end = time.monotonic() + deadline_s
    while True:
        got = info(url)
        if got["running"] == 0 and got["waiting"] == 0:
            break
        assert time.monotonic() < end, f"still busy after {deadline_s} s: {got['running']} " \
                                       f"running, {got['waiting']} waiting"
        time.sleep(0.02)
    pool = got["pool"]
    assert pool["balanced"] and pool["private"] == 0 and pool["protected"] == 0, pool
    return got


def aborted_by_disconnect(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    return float(next(line.rsplit(" ", 1)[1] for line in metrics.splitlines() if line.startswith(
        "phaseflip_aborted_requests_total{") and 'reason="client_disconnect"' in line))


def stream_and_leave(url: str, path: str, body: dict, events: int = 4) -> list[str]:
    """Streams `body` and hangs up after `events` data lines; returns them."""
    seen = []
    with httpx.stream("POST", url + path, json=body, timeout=10) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(line[6:])
                if len(seen) == events:
                    break
    assert len(seen) == events, seen  # (it hung up mid-answer, not after the end)
    return seen


def post_and_leave(url: str, path: str, body: dict, after_s: float = 0.3) -> None:
    """Posts `body` and hangs up after `after_s`, before the answer."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + path, json=body, timeout=httpx.Timeout(10, read=after_s))


def assert_aborted(url: str, before: int, sequences: int, engine_requests: int,
                   aborts_before: float) -> None:
    """The engine went idle soon, far short of the `LONG` tokens of each sequence, and each
    engine request (one per prompt) counts as aborted by a client that left."""
    idle(url)
    assert decoded(url) - before < sequences * LONG // 2
    assert aborted_by_disconnect(url) - aborts_before == engine_requests


# ------------------------------------------------------------------ /v1/responses
def test_a_streamed_response_whose_client_left_is_aborted_and_not_stored(server):
    """Aborted in the engine; and not kept: the answer never ended, so there is nothing
    `previous_response_id` or GET could continue from (vLLM's store, too, only keeps an
    answer once it is whole; a client gone before the end cancels it)."""
    before, aborts = decoded(server), aborted_by_disconnect(server)
    body = {"model": MODEL, "input": "Tell", "stream": True, "max_output_tokens": LONG,
            "ignore_eos": True, "store": True}
    events = [json.loads(e) for e in stream_and_leave(server, "/v1/responses", body, 6)]
    assert events[-1]["type"] == "response.output_text.delta"
    assert_aborted(server, before, 1, 1, aborts)
    response_id = events[0]["response"]["id"]
    assert httpx.get(f"{server}/v1/responses/{response_id}").status_code == 404


def test_a_response_whose_client_left_before_the_answer_is_aborted(server):
    before, aborts = decoded(server), aborted_by_disconnect(server)
    post_and_leave(server, "/v1/responses", {"model": MODEL, "input": "Tell",
                                             "max_output_tokens": LONG, "ignore_eos": True})
    assert_aborted(server, before, 1, 1, aborts)


# ------------------------------------------------------------------ /generate
def test_a_streamed_batch_whose_client_left_is_aborted_and_frees_its_rid(server):
    """Every prompt and sample is aborted, and the batch's rid is free again: it was kept
    for ever (a 400 "already in flight" to each later request of that rid) when the stream's
    cancellation, repeated at each await, skipped the code that let it go."""
    rid = f"batch-{uuid.uuid4().hex[:8]}"
    body = {"text": ["Tell", "Say"], "rid": rid, "stream": True,
            "sampling_params": {**LONG_PARAMS, "n": 2, "temperature": 1.0}}
    before, aborts = decoded(server), aborted_by_disconnect(server)
    stream_and_leave(server, "/generate", body)
    assert_aborted(server, before, 4, 2, aborts)
    again = httpx.post(server + "/generate", timeout=10, json={
        "text": ["Tell", "Say"], "rid": rid, "sampling_params": {"max_new_tokens": 2}})
    assert again.status_code == 200, again.text
    assert [o["meta_info"]["id"] for o in again.json()] == [f"{rid}-0", f"{rid}-1"]


def test_a_batch_whose_client_left_before_the_answer_is_aborted(server):
    before, aborts = decoded(server), aborted_by_disconnect(server)
    post_and_leave(server, "/generate", {"text": ["Tell", "Say", "Go"],
                                         "sampling_params": LONG_PARAMS})
    assert_aborted(server, before, 3, 3, aborts)


def test_a_rid_reused_right_after_its_client_left_gets_its_own_answer(served):
    """A client hangs up and at once retries with the same rid, while the engine is still in
    a step (paused here, to make the race certain): the retry gets a 400 until the engine has
    ended the old request, then its own answer; never the old request's end ("abort", which
    ended the retry at once while the engine ran it on for nobody)."""
    proc, url = served
    rid = f"retry-{uuid.uuid4().hex[:8]}"
    retry = {"text": "Tell", "rid": rid, "sampling_params": {"max_new_tokens": 5,
                                                             "ignore_eos": True}}
    stream = {"text": "Tell", "rid": rid, "stream": True, "sampling_params": LONG_PARAMS}
    with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url + "/generate", json=stream,
                                                     timeout=10) as r:
        # `lines` held: a dropped line iterator closes the connection when it is collected
        # (httpcore closes on GeneratorExit), a hang-up before the engine is paused
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        with engine_paused(proc.pid):
            r.close()  # hang up: the front end aborts the request, the engine sees it later
            end = time.monotonic() + 3  # until the front end has let the stream go (a 200
            # meanwhile aborts it once more, which changes nothing)
            while httpx.post(url + "/abort_request", json={"rid": rid}).status_code != 404:
                assert time.monotonic() < end, "the stream's request is still in flight"
                time.sleep(0.02)
            first = pool.submit(httpx.post, url + "/generate", json=retry, timeout=10)
            time.sleep(0.3)  # (it reaches the engine's inbox, if it is let through)
        r = first.result(timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    idle(url)
    r = httpx.post(url + "/generate", json=retry, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}, out
    assert len(out["output_ids"]) == 5
    idle(url)


# ------------------------------------------------------------------ under load
async def _one(client: httpx.AsyncClient, i: int, leave: bool) -> str:
    """One streamed request, of /v1/responses, /generate (two prompts, or n = 2) or chat;
    one that leaves asks for `LONG` tokens and hangs up after a few events."""
    tokens = LONG if leave else 12
    kind = i % 4
    if kind == 0:
        path, body = "/v1/responses", {"model": MODEL, "input": f"Tell {i}", "stream": True,
                                       "max_output_tokens": tokens, "ignore_eos": True}
    elif kind == 1:
        path, body = "/generate", {"text": [f"a {i}", f"b {i}"], "stream": True,
                                   "sampling_params": {"max_new_tokens": tokens,
                                                       "ignore_eos": True}}
    elif kind == 2:
        path, body = "/generate", {"text": f"c {i}", "stream": True, "sampling_params": {
            "max_new_tokens": tokens, "ignore_eos": True, "n": 2, "temperature": 1.0}}
    else:
        path, body = "/v1/chat/completions", {
            "model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"q{i}"}]}
    events, last = 0, ""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}"
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events, last = events + 1, line[6:]
                if leave and events == 4:  # (some of its tokens came)
                    return "left"
    if path == "/v1/responses":
        return "done" if json.loads(last)["type"] == "response.incomplete" else last
    return "done" if last == "[DONE]" else last


def test_a_hundred_streams_a_third_leaving(server):
    """Every request is answered to its end or aborted: none is lost, nothing runs or waits
    afterwards, and the pool balances."""
    leave = [r < 1 / 3 for r in (random.Random(7).random() for _ in range(100))]

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=120)
        async with httpx.AsyncClient(base_url=server, timeout=20, limits=limits) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(_one(client, i, leave[i]) for i in range(100))), 30)

    before = decoded(server)
    results = asyncio.run(main())
    assert results == ["left" if x else "done" for x in leave]
    got = idle(server)
    assert got["scheduler"]["decode_tokens"] - before < sum(leave) * LONG // 4
    abort_all = httpx.post(server + "/abort_request", json={"abort_all": True}, timeout=5)
    assert abort_all.json()["aborted"] == []  # nothing left in flight in the front end


def test_a_request_cancelled_before_the_engine_took_it_leaves_no_entry(tmp_path):
    """A request cancelled while its `AddRequest` waits for room on the socket (no engine
    reading: a full queue) sent nothing, so nothing is aborted and its id is free again
    (was: the send ran before the cleanup's `try`, and the id stayed in flight for good)."""
    from phaseflip.sampling.params import SamplingParams
    from phaseflip.server.engine_client import EngineClient

    async def go() -> None:
        client = EngineClient(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out", None)
        try:
            gen = client.generate("r1", [1, 2, 3], SamplingParams(max_new_tokens=4))
            task = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0.1)  # blocked in the send: no peer takes the message
            assert "r1" in client.state.in_flight and not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await gen.aclose()
            assert not client.in_use("r1") and client.state.widths == {}
        finally:
            await client.close()

    asyncio.run(asyncio.wait_for(go(), 10))


@asynccontextmanager
async def _client_and_fake_engine(tmp_path):
    """An `EngineClient` and the two sockets an engine process would hold, closed after."""
    import zmq
    import zmq.asyncio

    from phaseflip.server.engine_client import EngineClient

    client = EngineClient(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out", None)
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(f"ipc://{tmp_path}/req")
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(f"ipc://{tmp_path}/out")
    client.start()
    try:
        yield client, inbox, outbox
    finally:
        inbox.close(linger=0)
        outbox.close(linger=0)
        await client.close()


def test_a_request_failed_off_the_loop_keeps_its_id_until_its_abort_comes(tmp_path):
    """A grammar that fails to compile off the loop: the engine sends the 400 at once and the
    request's abort deltas at the end of its step. In between, a retry of the id is refused
    (was: accepted, and handed the old request's abort)."""
    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.errors import InvalidRequestError
    from phaseflip.sampling.params import SamplingParams
    from phaseflip.server import messages as m

    async def go() -> None:
        async with _client_and_fake_engine(tmp_path) as (client, inbox, outbox):
            gen = client.generate("g", [1, 2, 3], SamplingParams(max_new_tokens=4))
            first = asyncio.create_task(gen.__anext__())
            assert isinstance(m.decode(await inbox.recv()), m.AddRequest)
            await outbox.send(m.encode(m.RequestFailed(
                "g", "invalid_request_error", "bad grammar", "response_format", True)))
            with pytest.raises(InvalidRequestError):
                await first
            assert client.in_use("g")  # its abort deltas are still to come
            await outbox.send(m.encode(m.Deltas([StreamDelta(
                "g", 0, "", [], finish_reason="abort", usage=Usage(3, 0, 0))])))
            for _ in range(100):
                if not client.in_use("g"):
                    break
                await asyncio.sleep(0.01)
            assert not client.in_use("g")

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_request_sent_as_its_consumer_is_cancelled_is_aborted(tmp_path):
    """The socket completes a waiting `AddRequest` in the same loop turn as the consumer is
    cancelled: the request went out, so it is aborted and its id held until the engine ends
    it (was: taken for unsent; the engine ran it to its end for nobody)."""
    import zmq
    import zmq.asyncio

    from phaseflip.sampling.params import SamplingParams
    from phaseflip.server import messages as m
    from phaseflip.server.engine_client import EngineClient

    async def go() -> None:
        client = EngineClient(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out", None)
        client.start()
        send, consumer = client.out.send, {}

        def cancel_on_send(data, *a, **k):
            fut = send(data, *a, **k)
            if isinstance(m.decode(data), m.AddRequest):
                fut.add_done_callback(lambda _: consumer["task"].cancel())
            return fut

        client.out.send = cancel_on_send
        inbox = zmq.asyncio.Context().socket(zmq.PULL)
        try:
            gen = client.generate("s", [1, 2, 3], SamplingParams(max_new_tokens=4))
            consumer["task"] = task = asyncio.create_task(gen.__anext__())
            await asyncio.sleep(0.1)  # the send waits: no engine yet
            inbox.connect(f"ipc://{tmp_path}/req")  # the engine comes; the send completes
            with pytest.raises(asyncio.CancelledError):
                await task
            await gen.aclose()
            got = [type(m.decode(await asyncio.wait_for(inbox.recv(), 2))) for _ in range(2)]
            assert got == [m.AddRequest, m.AbortRequest]
            assert client.in_use("s")  # until the engine's end of it arrives
        finally:
            inbox.close(linger=0)
            await client.close()

    asyncio.run(asyncio.wait_for(go(), 10))


def test_a_consumer_leaving_after_the_end_came_sends_no_abort(tmp_path):
    """The engine's end is already in the request's queue when its consumer leaves (a client
    hanging up as the answer finished): nothing is aborted (the engine forgot the id; an
    abort would be a stray message) and the id is free at once."""
    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.sampling.params import SamplingParams
    from phaseflip.server import messages as m

    async def go() -> None:
        async with _client_and_fake_engine(tmp_path) as (client, inbox, outbox):
            gen = client.generate("e", [1, 2, 3], SamplingParams(max_new_tokens=1, n=2))
            first = asyncio.create_task(gen.__anext__())
            assert isinstance(m.decode(await inbox.recv()), m.AddRequest)
            await outbox.send(m.encode(m.Deltas([  # (two samples: waiting deltas of one
                StreamDelta("e", 0, "a", [7], finish_reason="length"),  # sample are joined)
                StreamDelta("e", 1, "b", [8]),
                StreamDelta("e", 1, "", [], finish_reason="length", usage=Usage(3, 2, 0))])))
            assert (await first).token_ids == [7]  # the end waits in the queue
            await gen.aclose()  # the consumer leaves
            assert not client.in_use("e")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(inbox.recv(), 0.3)  # no abort was sent

    asyncio.run(asyncio.wait_for(go(), 10))
