"""`/v1/responses` under pressure, against a real `phaseflip serve` (embedded model, CPU, a
512-token context, 4 answers kept) and the store alone: chains longer than the store, past the
context, through a deleted turn, from incomplete / cancelled / tool-call answers, forked
concurrently; streams whose events number up and end as the kept answer; malformed items that
name their field and never reach the engine; the store's byte bound and its accounting."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import httpx
import openai
import pytest

from phaseflip.server.response_store import (
    Kept,
    ResponseDeletedError,
    ResponseNotFoundError,
    ResponseStore,
    footprint_bytes,
)

MODEL = "tiny-llama"
KEPT = 4
CONTEXT = 512
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    from tests.server_process import start_server, stop_server

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        proc, url = start_server("--cpu-threads", "1", "--max-model-len", str(CONTEXT),
                                 "--responses-kept", str(KEPT), "--skip-warmup")
    yield url
    stop_server(proc)
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def ask(client, text: str, previous: str | None = None, **kw):
    return client.responses.create(model=MODEL, input=text, previous_response_id=previous,
                                   temperature=0, **{"max_output_tokens": 2, **kw})


def not_found(client, previous: str) -> dict:
    with pytest.raises(openai.NotFoundError) as err:
        ask(client, "again", previous)
    body = err.value.body
    assert body["code"] == "response_not_found" and body["param"] == "previous_response_id"
    return body


# ------------------------------------------------------------------ chains
def test_a_chain_longer_than_the_store_keeps_its_whole_conversation(client):
    """The head dropped, a later turn still continues the whole conversation: the prompt is
    the one the stateless client would send, not a shortened one."""
    turns, previous = [], None
    for i in range(KEPT + 2):
        r = ask(client, f"turn {i}", previous)
        turns.append((f"turn {i}", r))
        previous = r.id
    assert f"'{turns[0][1].id}'" in not_found(client, turns[0][1].id)["message"]
    follow = ask(client, "last", previous, max_output_tokens=1)
    replay = [m for text, r in turns for m in (
        {"role": "user", "content": text}, {"role": "assistant", "content": r.output_text})]
    alone = client.responses.create(model=MODEL, input=[*replay, {"role": "user",
                                                                  "content": "last"}],
                                    store=False, temperature=0, max_output_tokens=1)
    assert follow.usage.input_tokens == alone.usage.input_tokens


def test_a_chain_through_a_deleted_turn_is_refused_naming_it(client, server):
    a = ask(client, "one")
    b = ask(client, "two", a.id)
    c = ask(client, "three", b.id)
    assert httpx.delete(f"{server}/v1/responses/{b.id}").status_code == 200
    body = not_found(client, c.id)
    assert f"'{b.id}'" in body["message"] and "deleted" in body["message"]
    assert httpx.get(f"{server}/v1/responses/{c.id}").status_code == 200  # (c itself is kept)
    assert ask(client, "again", a.id).status in ("completed", "incomplete")


def test_a_chain_past_the_context_is_a_400_naming_it(client):
    long = "word " * 350  # ~360 tokens: fits alone, not after two turns of ~160
    a = ask(client, "word " * 150)
    b = ask(client, "word " * 150, a.id)
    assert ask(client, long).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, long, b.id)
    body = err.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "input"
    assert f"previous_response_id '{b.id}'" in body["message"]


def test_continuing_incomplete_and_cancelled_answers(client, server):
    cut = ask(client, "Tell", extra_body={"ignore_eos": True})
    assert cut.status == "incomplete"
    assert ask(client, "go on", cut.id).usage.input_tokens > cut.usage.input_tokens
    body = {"model": MODEL, "input": "Tell", "max_output_tokens": 200, "stream": True,
            "ignore_eos": True}
    events = []
    with httpx.stream("POST", server + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if len(events) == 5:
                    rid = events[0]["response"]["id"]
                    httpx.post(server + "/abort_request", json={"rid": rid}, timeout=10)
    cancelled = events[-1]["response"]
    assert cancelled["status"] == "cancelled"
    follow = ask(client, "go on", cancelled["id"])
    assert follow.usage.input_tokens > cancelled["usage"]["input_tokens"]


def test_function_call_outputs_in_a_chain(client):
    """An answer's call is answered once, by its call_id: a second output, or one for a call
    nobody made, is a 400 naming the item."""
    r = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                tool_choice="required", temperature=1.0,
                                extra_body={"seed": 3}, max_output_tokens=120)
    (call,) = r.output
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}
    done = client.responses.create(model=MODEL, previous_response_id=r.id, input=[output],
                                   temperature=0, max_output_tokens=2)
    for item, words in ((output, "second function_call_output"),
                        (output | {"call_id": "call_nobody"}, "no function_call")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.create(model=MODEL, previous_response_id=done.id,
                                    input=[{"role": "user", "content": "x"}, item])
        assert err.value.body["param"] == "input.1.call_id"
        assert words in err.value.body["message"]


def test_two_continuations_of_one_answer_are_independent(client, server):
    root = ask(client, "root")

    async def both():
        async with openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused",
                                      max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(c.responses.create(
                model=MODEL, input=text, previous_response_id=root.id, temperature=0,
                max_output_tokens=2) for text in ("left", "right")))

    left, right = asyncio.run(both())
    for branch, text in ((left, "left"), (right, "right")):
        items = httpx.get(f"{server}/v1/responses/{branch.id}/input_items").json()["data"]
        assert [i["content"][0]["text"] for i in items] == [text]
    follow = ask(client, "next", left.id, max_output_tokens=1)
    alone = client.responses.create(model=MODEL, store=False, temperature=0,
                                    max_output_tokens=1, input=[
        {"role": "user", "content": "root"},
        {"role": "assistant", "content": root.output_text},
        {"role": "user", "content": "left"},
        {"role": "assistant", "content": left.output_text},
        {"role": "user", "content": "next"}])
    assert follow.usage.input_tokens == alone.usage.input_tokens


# ------------------------------------------------------------------ streams
def test_a_stream_numbers_its_events_and_ends_as_kept(client, server):
    first = ask(client, "Return the")
    body = {"model": MODEL, "input": "and", "stream": True, "previous_response_id": first.id,
            "temperature": 0, "max_output_tokens": 6}
    with httpx.stream("POST", server + "/v1/responses", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    numbers = [e["sequence_number"] for e in events]
    assert numbers == sorted(set(numbers)) and numbers[0] == 0
    final = events[-1]["response"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert httpx.get(f"{server}/v1/responses/{final['id']}").json() == final


# ------------------------------------------------------------------ malformed input
FCALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
BAD_INPUTS = [
    ([1], "input.0"),
    (["hi"], "input.0"),
    ([{"type": "reasoning", "summary": []}], "input.0.type"),
    ([{"type": None, "role": "user", "content": "x"}], "input.0.type"),
    ([{"role": "tool", "content": "x"}], "input.0.role"),
    ([{"content": "x"}], "input.0.role"),
    ([{"role": "user"}], "input.0.content"),
    ([{"role": "user", "content": 5}], "input.0.content"),
    ([{"role": "user", "content": ["hi"]}], "input.0.content.0"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                   {"type": "input_image", "image_url": "x"}]}],
     "input.0.content.1.type"),
    ([{"role": "user", "content": [{"text": "a"}]}], "input.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "input_text"}]}], "input.0.content.0.text"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a", "x": 1}]}],
     "input.0.content.0.x"),
    ([{"role": "user", "content": "x", "x": 1}], "input.0.x"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ([FCALL | {"arguments": {}}], "input.0.arguments"),
    ([FCALL, {"type": "function_call_output", "call_id": "c1", "output": None}],
     "input.1.output"),
    ([FCALL, {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_file", "file_id": "f"}]}], "input.1.output.0.type"),
    ([{"role": "user", "content": "x"},
      {"type": "function_call_output", "call_id": "zz", "output": "x"}], "input.1.call_id"),
    ([FCALL, FCALL], "input.1.call_id"),
    ([FCALL, *[{"type": "function_call_output", "call_id": "c1", "output": "x"}] * 2],
     "input.2.call_id"),
]


def test_malformed_items_name_their_field_and_reach_no_engine(server):
    steps = httpx.get(server + "/server_info").json()["scheduler"]["steps"]
    wrong = []
    for items, param in BAD_INPUTS:
        r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": items},
                       timeout=30)
        got = r.json().get("error", {}).get("param") if r.status_code == 400 else r.status_code
        if got != param:
            wrong.append((items, param, got))
    assert not wrong
    assert httpx.get(server + "/server_info").json()["scheduler"]["steps"] == steps


# ------------------------------------------------------------------ the store alone
def turn(response_id: str, text: str, previous: Kept | None = None) -> Kept:
    return Kept({"id": response_id}, [{"role": "user", "content": text},
                                      {"role": "assistant", "content": text[::-1]}],
                [], previous)


def reachable_bytes(store: ResponseStore) -> int:
    """What the store must count, recounted from the outside: each kept answer and every
    answer its chain runs through, once."""
    seen: dict[int, int] = {}
    for link in list(store._index.values()):
        while link is not None and id(link) not in seen:
            # a deleted turn is hollow, even one an answer running from it held again
            assert not link.deleted or (link.size_bytes == 0 and link.previous is None)
            seen[id(link)] = link.size_bytes
            link = link.previous
    return sum(seen.values())


def test_the_byte_bound_drops_the_oldest_with_a_log_line(caplog):
    one = turn("r9", "a" * 999)
    size = footprint_bytes(one.body, one.messages, one.input_items)
    store = ResponseStore(100, max_bytes=3 * size)
    with caplog.at_level(logging.WARNING, logger="phaseflip.server"):
        for i in range(5):
            store.put(f"r{i}", turn(f"r{i}", "a" * 998 + str(i)))
    assert len(store) == 3 and store.held_bytes <= 3 * size
    for i in (0, 1):
        with pytest.raises(ResponseNotFoundError):
            store.get(f"r{i}")
    assert store.get("r4") and "responses store: dropped 1 of the oldest answers" in caplog.text


def test_a_chain_holds_its_turns_once_and_frees_them_with_its_last_answer():
    store = ResponseStore(2)
    a = turn("a", "x" * 500)
    store.put("a", a)
    b = turn("b", "y" * 500, store.get("a"))
    store.put("b", b)
    c = turn("c", "z" * 500, store.get("b"))
    store.put("c", c)  # a leaves the index, still held by b
    assert [m["content"] for m in store.get("c").conversation()][::2] == [
        "x" * 500, "y" * 500, "z" * 500]
    assert store.held_bytes == a.size_bytes + b.size_bytes + c.size_bytes
    store.put("d", turn("d", "d"))
    store.put("e", turn("e", "e"))  # the chain's last answer leaves: a, b, c are freed
    assert store.held_bytes == reachable_bytes(store)


def test_deleting_a_held_turn_frees_it_and_refuses_its_followers():
    store = ResponseStore(10)
    store.put("a", turn("a", "x" * 500))
    store.put("b", turn("b", "y" * 500, store.get("a")))
    store.put("c", turn("c", "z" * 500, store.get("b")))
    store.delete("b")
    assert store.held_bytes == reachable_bytes(store)
    with pytest.raises(ResponseDeletedError, match="'b'.*deleted"):
        store.get("c").conversation("previous_response_id")
    store.delete("a")
    store.delete("c")
    assert store.held_bytes == 0 and len(store) == 0


def test_the_accounting_holds_under_random_puts_forks_evictions_and_deletes():
    rng, store = random.Random(0), ResponseStore(8, max_bytes=20_000)
    for n in range(600):
        op, live = rng.random(), list(store._index)
        if op < 0.15 and live:
            store.delete(rng.choice(live))
        else:
            previous = store.get(rng.choice(live)) if live and op < 0.8 else None
            if previous is not None and op < 0.3:  # evicted while it ran
                store.put(f"x{n}", turn(f"x{n}", "q" * 3000))
            elif previous is not None and op < 0.4 and previous.body["id"] in store._index:
                store.delete(previous.body["id"])  # deleted while it ran
            store.put(f"r{n}", turn(f"r{n}", "t" * rng.randrange(1, 2000), previous))
        assert store.held_bytes == reachable_bytes(store) <= store.max_bytes


def test_a_long_chain_through_the_handler_holds_each_turn_once(monkeypatch):
    """`create_response` over a scripted engine, 100 turns chained: each answer keeps its own
    turn linked to the one before, so the store holds ~100 turns; keeping each answer's whole
    conversation held 100·101/2 (quadratic: 82 MiB for 3000 short turns, 13 MiB linked)."""
    from types import SimpleNamespace

    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.server import responses_api as ra
    from phaseflip.server.openai_api import PromptRun
    from phaseflip.server.protocol import responses_api as rp

    async def prepare(ctx, chat, rid, names):
        return PromptRun(rid, [1], None, 0), None

    async def scripted(ctx, runs):
        yield runs[0], StreamDelta(runs[0].rid, 0, "fine", [1], finish_reason="stop",
                                   usage=Usage(1, 1, 0))

    async def connected() -> bool:
        return False

    monkeypatch.setattr(ra, "prepare_chat", prepare)
    monkeypatch.setattr(ra, "run_prompts", scripted)
    ctx = SimpleNamespace(model_name=MODEL, check_model=lambda _: None)
    request, store = SimpleNamespace(is_disconnected=connected), ResponseStore(1000)

    async def chain(turns: int) -> str:
        previous = None
        for i in range(turns):
            req = rp.ResponsesRequest.model_validate(
                {"model": MODEL, "input": f"turn {i}", "previous_response_id": previous})
            answer = await ra.create_response(req, request, ctx, store)
            previous = json.loads(answer.body)["id"]
        return previous

    last = asyncio.run(chain(100))
    conversation = store.get(last).conversation()
    assert [m["content"] for m in conversation[-4:]] == ["turn 98", "fine", "turn 99", "fine"]
    one_turn = min(kept.size_bytes for kept in store._index.values())
    assert len(conversation) == 200 and store.held_bytes <= 1.2 * 100 * one_turn


def test_a_turn_deleted_while_its_follow_up_runs_holds_nothing_after():
    """The follow-up's answer is kept after the generation: it held the deleted turn again,
    with its old size and the turns before it, so the byte bound dropped live answers for
    memory nothing could reach (a chain through it is refused anyway)."""
    store = ResponseStore(10, max_bytes=10**9)
    store.put("p", turn("p", "x" * 50_000))
    store.put("a", turn("a", "y" * 50_000, store.get("p")))
    previous = store.get("a")  # a follow-up starts
    store.delete("p")
    store.delete("a")  # both deleted while it runs
    answer = turn("r", "z", previous)
    store.put("r", answer)
    assert store.held_bytes == answer.size_bytes == reachable_bytes(store)
    with pytest.raises(ResponseDeletedError):
        answer.conversation("previous_response_id")
    store.delete("r")
    assert store.held_bytes == 0
