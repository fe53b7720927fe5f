"""A stream whose consumer fell behind gets the deltas waiting for it as one (`EngineClient.
generate`, `StreamDelta.joined`): one chunk and one socket write instead of one per engine step
(the front end's cost per chunk bounds the tokens a second it can deliver:
docs/benchmarks.md, "The front end's cost per token"). Red before: five waiting deltas were
yielded as five."""

from __future__ import annotations

import asyncio
import tempfile

import pytest
import zmq

from phaseflip.engine.outputs import StreamDelta, Usage
from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.params import SamplingParams
from phaseflip.server import messages as m
from phaseflip.server.engine_client import EngineClient


def delta(i: int, index: int = 0, **kw) -> StreamDelta:
    return StreamDelta("r", index, f"t{i} ", [i], **kw)


def test_join_keeps_every_token_and_the_last_deltas_ending():
    a = delta(1, logprobs=[-0.1], top_logprobs=[[(1, -0.1)]], cached_tokens=3,
              prompt_logprobs=[None, -1.0], prompt_top_logprobs=[None, [(5, -1.0)]])
    b = delta(2, logprobs=[-0.2], top_logprobs=[[(2, -0.2)]])
    c = delta(3, logprobs=[-0.3], top_logprobs=[[(3, -0.3)]], finish_reason="stop",
              matched_stop=3, usage=Usage(4, 3, 3))
    assert a.joins(b) and b.joins(c)
    j = StreamDelta.joined([a, b, c])
    assert (j.text, j.token_ids, j.logprobs) == ("t1 t2 t3 ", [1, 2, 3], [-0.1, -0.2, -0.3])
    assert j.top_logprobs == [[(1, -0.1)], [(2, -0.2)], [(3, -0.3)]]
    assert (j.finish_reason, j.matched_stop, j.usage) == ("stop", 3, Usage(4, 3, 3))
    assert (j.cached_tokens, j.prompt_logprobs) == (3, [None, -1.0])
    assert j.prompt_top_logprobs == [None, [(5, -1.0)]]
    assert (a.text, a.token_ids, a.logprobs) == ("t1 ", [1], [-0.1]), "a join changed its input"
    assert StreamDelta.joined([delta(1), delta(2)]).logprobs is None
    assert not c.joins(delta(4)), "nothing joins a sample's last delta"
    assert not a.joins(delta(2, index=1)), "another sample's delta"


async def _drain(items: list, read: int | None = None, sent: list | None = None
                 ) -> tuple[list[StreamDelta], Exception | None]:
    """What `generate` yields when `items` wait in its queue before its consumer reads (the
    consumer stops after `read` deltas if given); `sent` gets what it sent the engine."""
    tmp = tempfile.mkdtemp(prefix="pf-")
    client = EngineClient(f"ipc://{tmp}/req", f"ipc://{tmp}/out", None)
    peer = zmq.Context.instance().socket(zmq.PULL)  # takes the AddRequest
    peer.connect(f"ipc://{tmp}/req")
    got: list[StreamDelta] = []
    stream = client.generate("r", [1, 2], SamplingParams(max_new_tokens=8))
    try:
        first = asyncio.ensure_future(stream.__anext__())
        while "r" not in client.state.in_flight:
            await asyncio.sleep(0.001)
        q = client.state.in_flight["r"]
        for item in items:
            q.put_nowait(item)
        got.append(await first)
        while read is None or len(got) < read:
            try:
                got.append(await stream.__anext__())
            except StopAsyncIteration:
                break
    except Exception as e:  # noqa: BLE001 — returned to the test
        return got, e
    finally:
        await stream.aclose()
        await asyncio.sleep(0.05)
        while sent is not None and peer.poll(0):
            sent.append(type(m.decode(peer.recv())).__name__)
        if sent is not None and client.state.leaving:
            sent.append("leaving")
        peer.close(0)
        await client.close()
    return got, None


def test_waiting_deltas_come_as_one():
    items = [delta(i) for i in range(1, 5)] + [delta(5, finish_reason="length",
                                                     usage=Usage(2, 5, 0))]
    got, err = asyncio.run(_drain(items))
    assert err is None
    assert [(d.text, d.token_ids, d.finish_reason) for d in got] == [
        ("t1 t2 t3 t4 t5 ", [1, 2, 3, 4, 5], "length")]
    assert got[0].usage == Usage(2, 5, 0)


def test_samples_stay_apart_and_in_order():
    items = [delta(1), delta(2), delta(3, index=1), delta(4, index=1), delta(5),
             delta(6, index=1, finish_reason="stop"), delta(7, finish_reason="stop",
                                                             usage=Usage(2, 7, 0))]
    got, err = asyncio.run(_drain(items))
    assert err is None
    assert [(d.index, d.token_ids) for d in got] == [
        (0, [1, 2]), (1, [3, 4]), (0, [5]), (1, [6]), (0, [7])]


def test_a_failure_after_waiting_deltas_still_fails_the_stream():
    items = [delta(1), delta(2), m.RequestFailed("r", "invalid_request_error", "bad", "x")]
    got, err = asyncio.run(_drain(items))
    assert [d.token_ids for d in got] == [[1, 2]]
    assert isinstance(err, InvalidRequestError) and "bad" in str(err)


def test_a_consumer_that_leaves_holding_the_end_aborts_nothing():
    """The end was taken from the queue while joining (another sample's): leaving then must
    not abort a request the engine already ended, nor wait for an end that came."""
    items = [delta(1), delta(2, index=1, finish_reason="stop", usage=Usage(2, 2, 0))]
    sent: list[str] = []
    got, _ = asyncio.run(_drain(items, read=1, sent=sent))
    assert [d.token_ids for d in got] == [[1]]
    assert sent == ["AddRequest"], sent
    # (and one that leaves with nothing of its end taken does abort)
    sent = []
    asyncio.run(_drain([delta(1), delta(2, index=1)], read=1, sent=sent))
    assert sent[:2] == ["AddRequest", "AbortRequest"] and "leaving" in sent, sent


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_that_keeps_up_gets_every_delta(n):
    """Nothing waits: each delta is yielded as it comes (no join, no delay)."""
    async def run() -> list[StreamDelta]:
        tmp = tempfile.mkdtemp(prefix="pf-")
        client = EngineClient(f"ipc://{tmp}/req", f"ipc://{tmp}/out", None)
        peer = zmq.Context.instance().socket(zmq.PULL)
        peer.connect(f"ipc://{tmp}/req")
        stream = client.generate("r", [1], SamplingParams(max_new_tokens=8))
        got = []
        try:
            nxt = asyncio.ensure_future(stream.__anext__())
            while "r" not in client.state.in_flight:
                await asyncio.sleep(0.001)
            q = client.state.in_flight["r"]
            for i in range(1, n + 1):
                end = {"finish_reason": "length", "usage": Usage(1, n, 0)} if i == n else {}
                q.put_nowait(delta(i, **end))
                got.append(await nxt)
                if i < n:
                    nxt = asyncio.ensure_future(stream.__anext__())
        finally:
            await stream.aclose()
            peer.close(0)
            await client.close()
        return got

    assert [d.token_ids for d in asyncio.run(run())] == [[i] for i in range(1, n + 1)]
