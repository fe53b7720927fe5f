"""`/v1/responses` through a real `phaseflip serve` (the embedded model, CPU) and the official
`openai` client: the same answers as chat (greedy), streamed events that add up to the whole
answer, follow-ups by `previous_response_id`, tools, structured output, logprobs, the store,
and the 400/404s."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from phaseflip.server.response_store import Kept, ResponseNotFoundError, ResponseStore

MODEL = "tiny-llama"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}


def chat_text(client, messages, **kw) -> str:
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return got.choices[0].message.content


def test_an_answer_is_chats_answer(client):
    r = client.responses.create(model=MODEL, instructions="Answer briefly.",
                                input="What does os.path.join do?", temperature=0,
                                max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat_text(client, [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What does os.path.join do?"}], max_completion_tokens=12)
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == 12:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # a list of messages, typed parts included, is the same conversation
    again = client.responses.create(model=MODEL, temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What does os.path.join do?"}]}])
    assert again.output_text == r.output_text


def test_a_stream_adds_up_to_the_whole_answer(client):
    kwargs = {"model": MODEL, "input": "Return the", "temperature": 0, "max_output_tokens": 10}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text
    assert final.id == events[0].response.id and final.usage.output_tokens == \
        whole.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:  # the client's own assembly
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        if whole.status == "completed":  # (on an incomplete one the helper raises)
            assert stream.get_final_response().output_text == text
    assert text == whole.output_text


def test_a_follow_up_continues_the_conversation(client, server):
    first = client.responses.create(model=MODEL, input="Name a module.", temperature=0,
                                    max_output_tokens=6, instructions="Be brief.")
    second = client.responses.create(model=MODEL, input="And another?", temperature=0,
                                     max_output_tokens=6, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # instructions do not carry over; the earlier turns do
    assert second.output_text == chat_text(client, [
        {"role": "user", "content": "Name a module."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}], max_completion_tokens=6)
    got = httpx.get(f"{server}/v1/responses/{first.id}").json()
    assert got["id"] == first.id and got["output"][0]["content"][0]["text"] == first.output_text
    assert httpx.delete(f"{server}/v1/responses/{first.id}").json()["deleted"] is True
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    assert httpx.get(f"{server}/v1/responses/{unkept.id}").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_and_its_output(client, stream):
    kwargs = {"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER],
              "tool_choice": "required", "temperature": 1.0, "extra_body": {"seed": 3},
              "max_output_tokens": 120}
    if stream:
        with client.responses.stream(**kwargs) as s:
            for _ in s:
                pass
            r = s.get_final_response()
    else:
        r = client.responses.create(**kwargs)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and isinstance(json.loads(call.arguments), dict)
    done = client.responses.create(
        model=MODEL, previous_response_id=r.id, temperature=0, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}])
    assert done.status in ("completed", "incomplete") and done.output[0].type == "message"


class City(BaseModel):
    name: str = Field(max_length=10)
    size: Literal["small", "big"]


def test_structured_output_and_logprobs(client):
    r = client.responses.parse(model=MODEL, input="A city:", text_format=City, temperature=1.0,
                               extra_body={"seed": 2}, max_output_tokens=60)
    assert isinstance(r.output_parsed, City)
    lp = client.responses.create(model=MODEL, input="Return the", temperature=0,
                                 max_output_tokens=5, top_logprobs=2,
                                 include=["message.output_text.logprobs"])
    logprobs = lp.output[0].content[0].logprobs
    assert len(logprobs) == lp.usage.output_tokens
    assert all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in logprobs)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"background": True}, "background", "not supported"),
    ({"input": []}, "input", "non-empty"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input", "only text content"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "'reasoning'"),
    ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
    ({"nope": 1}, "nope", ""),
])
def test_bad_requests_name_the_field(server, body, param, words):
    r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "x"} | body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and param in err["param"] and words in err["message"]


def test_the_store_keeps_the_newest():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", Kept({"id": f"r{i}"}, []))
    with pytest.raises(ResponseNotFoundError):
        store.get("r0")
    store.get("r1")  # used: now the newest
    store.put("r3", Kept({}, []))
    assert store.get("r1") and store.get("r3")
    with pytest.raises(ResponseNotFoundError):
        store.get("r2")
    ResponseStore(0).put("x", Kept({}, []))  # keeps none


def test_an_answer_replayed_as_input_is_accepted(client):
    """The stateless way (`store: false`): the next input is the old input plus the answer's
    own output items, as the client hands them back."""
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                    tool_choice="required", store=False, temperature=0,
                                    max_output_tokens=60)
    call = first.output[0]
    chained = [{"role": "user", "content": "Weather in Oslo?"}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    second = client.responses.create(model=MODEL, input=chained, store=False, temperature=0,
                                     max_output_tokens=6)
    third = client.responses.create(model=MODEL, store=False, temperature=0,
                                    max_output_tokens=4,
                                    input=[*chained, *second.output,
                                           {"role": "user", "content": "Thanks."}])
    assert second.output_text and third.output[0].type == "message"


def test_errors_on_the_chat_path_name_the_responses_field(server):
    def error(body):
        r = httpx.post(server + "/v1/responses", json={"model": MODEL, "input": "x"} | body)
        assert r.status_code == 400, r.text
        return r.json()["error"]

    err = error({"min_tokens": 10, "max_output_tokens": 5})
    assert err["param"] == "min_tokens" and "max_output_tokens" in err["message"]
    err = error({"tools": [WEATHER], "tool_choice": "required",
                 "text": {"format": {"type": "json_object"}}})
    assert err["param"] == "text.format" and "text.format" in err["message"]
    assert error({"input": [{"role": "tool", "content": "x"}]})["param"] == "input.0.role"
    err = error({"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]})
    assert err["param"] == "input.0.call_id" and "'zz'" in err["message"]


def test_an_empty_answer_is_continued(client):
    """An answer ended by its first token has no text: kept, it is still an assistant turn."""
    kwargs = {"model": MODEL, "input": "Weather in Oslo?", "temperature": 0}
    first = client.responses.create(**kwargs, max_output_tokens=1,
                                    include=["message.output_text.logprobs"])
    token = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"),
                       json={"prompt": first.output_text, "add_special_tokens": False})
    empty = client.responses.create(**kwargs, max_output_tokens=5,
                                    extra_body={"stop_token_ids": token.json()["tokens"][:1]})
    assert empty.output_text == "" and empty.status == "completed"
    after = client.responses.create(model=MODEL, input="again", previous_response_id=empty.id,
                                    max_output_tokens=2)
    assert after.status in ("completed", "incomplete")


def test_replayed_dumps_and_streamed_logprobs_with_tools(client):
    """Output items dumped with every field (`model_dump()`, nulls included) replay as input;
    with tools offered, a stream's logprobs still cover every token."""
    kwargs = {"model": MODEL, "input": "Weather in Oslo?", "tools": [WEATHER], "temperature": 0,
              "max_output_tokens": 12, "include": ["message.output_text.logprobs"]}
    whole = client.responses.create(**kwargs)
    *_, last = client.responses.create(**kwargs, stream=True)
    logprobs = last.response.output[0].content[0].logprobs
    assert len(logprobs) == len(whole.output[0].content[0].logprobs) == \
        whole.usage.output_tokens
    replay = [{"role": "user", "content": "Weather in Oslo?"},
              *(o.model_dump() for o in whole.output), {"role": "user", "content": "Thanks"}]
    assert client.responses.create(model=MODEL, input=replay, max_output_tokens=2).output


def test_abort_by_the_responses_own_id(server):
    body = {"model": MODEL, "input": "Tell", "max_output_tokens": 500, "stream": True,
            "ignore_eos": True}
    events = []
    with httpx.stream("POST", server + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 6:  # a few deltas in
                rid = events[0]["response"]["id"]
                assert httpx.post(server + "/abort_request", json={"rid": rid}).status_code == 200
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "cancelled"
    assert {item["status"] for item in final["response"]["output"]} == {"incomplete"}


PIECES = ["Let", " me", " check", ".\n", "<tool", "_call>\n",
          '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
          "\n</tool_call>\n<tool_call>\n",
          '{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>']


def scripted_run(monkeypatch, pieces: list[str], end: str | Exception):
    """Runs an auto-tools request over `pieces` (the tiny model makes no calls of itself),
    whole and streamed; the last piece ends with finish reason `end`, or `end` is raised
    after the pieces. Returns (whole answer or None, stream events)."""
    from types import SimpleNamespace

    from phaseflip.engine.outputs import StreamDelta, Usage
    from phaseflip.server import protocol as p
    from phaseflip.server import responses_api as ra
    from phaseflip.server import tools
    from phaseflip.server.openai_api import PromptRun
    from phaseflip.server.protocol import responses_api as rp

    async def scripted(ctx, runs):
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1 and isinstance(end, str)
            yield runs[0], StreamDelta("r", 0, text, [1], finish_reason=end if last else None,
                                       usage=Usage(10, len(pieces), 0) if last else None)
        if isinstance(end, Exception):
            raise end

    monkeypatch.setattr(ra, "run_prompts", scripted)
    ctx = SimpleNamespace(model_name=MODEL)

    def exchange():
        req = rp.ResponsesRequest.model_validate({"model": MODEL, "input": "w?",
                                                  "tools": [WEATHER]})
        plan = tools.plan_tools(p.ChatCompletionRequest.model_validate(rp.to_chat(req, [])))
        return ra.Exchange(req, PromptRun("resp_x", [1], None, 0), plan, [], "resp_x")

    async def run():
        store = ra.ResponseStore(4)
        whole = None if isinstance(end, Exception) else await ra._answer(ctx, store,
                                                                         exchange())
        events = [json.loads(e.split("data: ", 1)[1])
                  async for e in ra._events(ctx, store, exchange())]
        return whole, events

    return asyncio.run(run())


def one_after_another(events: list[dict]) -> None:
    open_items: set[int] = set()
    for e in events:
        if e["type"] == "response.output_item.added":
            assert not open_items, f"item {open_items} still open at {e['sequence_number']}"
            open_items.add(e["output_index"])
        elif e["type"] == "response.output_item.done":
            open_items.remove(e["output_index"])
        elif "output_index" in e:
            assert e["output_index"] in open_items, e
    assert not open_items


@pytest.mark.parametrize("end", ["stop", "length"])
def test_items_stream_one_after_another(monkeypatch, end):
    """Text and then two calls: each item's done events come before the next item's added,
    and the stream ends with the items (and statuses) the whole answer has; cut by length,
    the last item is the incomplete one."""
    pieces = PIECES if end == "stop" else [*PIECES[:-1], '{"name": "get_weather", "arg']
    whole, events = scripted_run(monkeypatch, pieces, end)
    one_after_another(events)
    final = events[-1]["response"]
    shape = [(o["type"], o.get("name"), o.get("arguments"), o["status"]) for o in final["output"]]
    assert shape == [(o["type"], o.get("name"), o.get("arguments"), o["status"])
                     for o in whole["output"]]
    assert final["output"][0]["content"][0]["text"] == "Let me check."
    if end == "stop":
        assert [s[2] for s in shape[1:]] == ['{"city": "Oslo"}', '{"city": "Bergen"}']
        assert {s[3] for s in shape} == {"completed"}
    else:  # (an auto call cut short does not parse: the first call is the last item)
        assert [s[3] for s in shape] == ["completed", "incomplete"]
        assert events[-1]["type"] == "response.incomplete"


def test_a_failing_stream_ends_failed(monkeypatch):
    from phaseflip.server.engine_client import EngineDeadError

    _, events = scripted_run(monkeypatch, PIECES[:3], EngineDeadError("the engine died"))
    one_after_another(events)
    assert "error" in [e["type"] for e in events]
    final = events[-1]
    assert final["type"] == "response.failed" and final["response"]["status"] == "failed"
    assert final["response"]["error"]["message"] == "the engine died"
    assert {o["status"] for o in final["response"]["output"]} == {"incomplete"}


def test_renamed_errors_keep_other_words():
    from phaseflip.errors import InvalidRequestError
    from phaseflip.server.context import renamed

    e = renamed(InvalidRequestError("logprobs must be in [0, 5] (prompt_logprobs too)",
                                    "logprobs"), {"logprobs": "top_logprobs"})
    assert (str(e), e.param) == ("top_logprobs must be in [0, 5] (prompt_logprobs too)",
                                 "top_logprobs")
