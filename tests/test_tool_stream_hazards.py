"""Tool-call parsing hazards a review of the streamed `auto` parser found (`AutoReader`,
`SpecialStripper`; each was red before its fix): key order deciding whether an unlisted Hermes
call counts, nesting past the recursion limit (a 500), per-delta cost growing with the output
(whitespace runs, unclosed names), braces that close on arguments that are not JSON, lone
surrogates in names, and names past `NAME_CAP`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import httpx
import pytest

from phaseflip.server import protocol as p
from phaseflip.server import tool_parsers as tools_parsers
from phaseflip.server import tools
from tests import fake_engine
from tests.test_tool_formats import (
    TOOLS,
    _scripted_engine,
    mistral_tokenizer,  # noqa: F401 (a fixture)
)
from tests.test_tool_parsers import _plan, _stream

SEARCH = ("search", '{"q": "x"}')


# BUG 1 (stale `AutoReader.within`): a Hermes block's call may name any tool (as the old
# parser did, and as `<tool_call>{"name": "search", "arguments": {...}}` still does), but
# a block read whole (arguments as JSON text, or `"name"` not first) is checked against
# `self.within`, which `_start` set to the listed names before the answer turned out to be
# plain text. So whether an unlisted Hermes call counts depends on its key order, on
# whether its arguments are an object, and even on whether the answer begins with `[`.
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>',
    '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
    'Let me search.\n<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>',
])
def test_hermes_unlisted_call_read_whole_is_a_call(text) -> None:
    plan = _plan()
    content, calls = tools.parse_output(plan, text)
    assert calls == [SEARCH], (content, calls)
    # the same block after an answer that began with "[" (within reset to None) is a call
    assert tools.parse_output(plan, "[x " + text)[1] == [SEARCH]


# BUG 2 (RecursionError -> 500; there before the change, kept by it): `json_object` and
# `_call` catch ValueError only; json.loads
# raises RecursionError at ~1 000 levels of nesting. An object read whole (arguments given as
# JSON text, or another key first) with a deeply nested value makes `parse_output` (and
# `finish_reason`, and the stream's `ToolStreamer.feed`) raise. ~1 200 characters suffice.
DEEP = {
    "string_args": '<tool_call>{"name": "get_time", "arguments": "' + "[" * 1200 + '"}</tool_call>',
    "other_key_first": '<tool_call>{"arguments": {}, "name": "get_time", "x": '
                       + "[" * 1200 + "]" * 1200 + "}</tool_call>",
    "llama_other_key": '{"name": "get_time", "x": ' + "[" * 1200 + "]" * 1200
                       + ', "parameters": {}}',
}


@pytest.mark.parametrize("case", DEEP)
def test_deeply_nested_json_is_not_an_error(case) -> None:
    text, plan = DEEP[case], _plan()
    tools.parse_output(plan, text)  # RecursionError
    plan.finish_reason("stop", True, text)
    _stream(plan, [text[i:i + 7] for i in range(0, len(text), 7)], True)


def test_deeply_nested_json_through_the_server_is_not_a_500(tmp_path, monkeypatch,
                                                           mistral_tokenizer) -> None:  # noqa: F811
    tok = mistral_tokenizer
    script = [*tok.encode(DEEP["string_args"], add_special_tokens=False),
              tok.convert_tokens_to_ids("</s>")]
    holder = _scripted_engine(monkeypatch, tok, script)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Time?"}],
            "tools": TOOLS, "max_tokens": len(script)}

    async def go() -> tuple[int, str]:
        async with fake_engine.fake_server(tmp_path, step_s=0.0005) as (ctx, app, engine), \
                httpx.AsyncClient(transport=httpx.ASGITransport(
                    app=app, raise_app_exceptions=False), base_url="http://t") as c:
            holder["engine"] = engine
            state = ctx.engine.state  # (the fake's 1 024-token context: too short for it)
            state.ready = dataclasses.replace(state.ready, max_context=8192)
            r = await c.post("/v1/chat/completions", json=chat, timeout=60)
            return r.status_code, r.text[:300]

    status, body = asyncio.run(asyncio.wait_for(go(), 120))
    assert status == 200, body


# BUG 3 (per-delta cost grows with the output: Python loops that rescan from a fixed point each
# delta). `_rstripped` walks back over a whole trailing whitespace run every delta (plain
# content); `_next_item` re-skips every separator after `[TOOL_CALLS]` every delta (it does not
# advance `pos` when it returns None); `_object_head` re-reads an unclosed `"name"` holding a
# backslash from the object's start every delta (and holds it back however long it gets; the
# old `may_begin_call` looked at 4 096 characters at most). Measured on this machine, old
# ToolStreamer vs new, 2 characters a delta: "Hi" + 16 000 "\n": 0.11 s vs 4.7 s;
# "[TOOL_CALLS]" + 16 000 " ": 0.01 s vs 19 s; '{"name": "\"' + 16 000 chars: 0.08 s vs 4.3 s.
# The streamer runs on the server's event loop, so this stalls every other request.
SLOW = {
    "newlines_after_content": "Hi" + "\n" * 16000,
    "spaces_after_marker": "[TOOL_CALLS]" + " " * 16000,
    "escaped_unclosed_name": '{"name": "\\"' + "ab" * 8000,
    # (Hermes takes any name: `_STRING.match` backtracks over the whole unclosed name each
    # delta, ~5 ms a delta at 50 000 characters; not fixed by the patch in the report)
    "hermes_unclosed_name": '<tool_call>{"name": "' + "ab" * 8000,
}


@pytest.mark.parametrize("case", SLOW)
def test_whitespace_runs_and_unclosed_names_stream_in_linear_time(case) -> None:
    text = SLOW[case]
    streamer = tools.ToolStreamer(_plan())
    t = time.perf_counter()
    for i in range(0, len(text), 2):
        streamer.feed(text[i:i + 2], False)
    streamer.feed("", True)
    assert time.perf_counter() - t < 1.5  # (old code: ≤ 0.11 s; linear new code: ~0.05 s)


# BUG 4 (arguments that are not JSON are a finished call): a call is certain at its `{`, and
# its arguments are whatever text closes the braces, never parsed; `whole` only means the
# braces balanced. So a model's malformed call answers finish_reason "tool_calls" with
# arguments a client's `json.loads` rejects, and prose that begins with a listed name and a
# `{` (before the change: content) becomes that call and loses the rest of the answer.
# "stop" (as for arguments not whole) would tell the client not to run them.
@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": Oslo}}',
    'get_weather {city} returns the weather for a city.',
])
def test_arguments_that_are_not_json_do_not_finish_as_tool_calls(text) -> None:
    plan = _plan()
    content, calls = tools.parse_output(plan, text)
    reason = plan.finish_reason("stop", bool(calls), text)
    for _, args in calls:
        try:
            json.loads(args)
        except ValueError:
            assert reason != "tool_calls", (calls, reason)


# BUG 5 (a lone surrogate in a call's name -> 500 / a broken stream; there before too):
# after a marker any name
# is a call, and `"\ud800"` decodes to a lone surrogate, which no response can carry
# (pydantic: "surrogates not allowed"). `_dumps` guards the arguments against exactly this,
# not the name (`_unquote` for calls named at their brace, `_call` for those read whole).
@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
    # (read whole: `_call` checks this name, `_unquote` the ones named at their brace)
    '<tool_call>{"name": "\\ud800", "arguments": "{}"}</tool_call>',
    '[TOOL_CALLS][{"name": "a\\udfff", "arguments": {"x": 1}}]',
])
def test_a_call_name_with_a_lone_surrogate_is_not_sent(text) -> None:
    plan = _plan()
    _, calls = tools.parse_output(plan, text)
    for name, _ in calls:
        name.encode("utf-8")  # UnicodeEncodeError: the response cannot be serialised
    _, deltas, _ = _stream(plan, list(text), True)
    for d in deltas:
        p.DeltaToolCall.model_validate(d).model_dump_json()


# NAME_CAP: a name longer than any function name is no call, whole or streamed alike
@pytest.mark.parametrize("length, is_call", [(tools_parsers.NAME_CAP, True),
                                             (tools_parsers.NAME_CAP + 1, False)])
def test_a_name_past_the_cap_is_no_call(length, is_call) -> None:
    name = "a" * length
    text = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>'
    plan = _plan()
    content, calls = tools.parse_output(plan, text)
    assert calls == ([(name, "{}")] if is_call else [])
    got, deltas, _ = _stream(plan, [text[i:i + 7] for i in range(0, len(text), 7)], True)
    assert got == (content or "") and bool(deltas) == is_call


# A bare `name {` (Mistral's call once `[ARGS]` was skipped) is a call only where a JSON
# object follows: prose that names a tool and a brace stays content, whole and streamed
@pytest.mark.parametrize("text, is_call", [
    ("get_weather {city} returns the weather for a city.", False),
    ("get_weather { city } is the tool.", False),
    ('get_weather{"city": "Oslo"}', True),
    ("get_weather {}", True),
])
def test_a_bare_name_and_brace_needs_a_json_object(text, is_call) -> None:
    plan = _plan()
    content, calls = tools.parse_output(plan, text)
    assert bool(calls) == is_call and (content is None) == is_call
    got, deltas, _ = _stream(plan, list(text), True)
    assert got == (content or "") and bool(deltas) == is_call
