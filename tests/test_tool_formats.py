"""Tool-call formats `tool_choice: "auto"` reads beyond `test_tool_parsers`: Llama 3.2's pythonic
calls (whole and streamed at every split; literals only), and Mistral's `[TOOL_CALLS]` after
content, which reaches the parser only because an auto request is decoded with its special
tokens kept (the content still without them). The Mistral tests run the real front end (chat
and Responses, whole and streamed) against the scripted engine of `tests/fake_engine.py`,
whose deltas here are a fixed token script decoded by the engine's own detokenizer with the
request's `skip_special_tokens`."""

from __future__ import annotations

import asyncio
import json

import pytest

from phaseflip.engine.outputs import StreamDelta, Usage
from phaseflip.sampling.detokenize import IncrementalDetokenizer, partial_stop_len
from phaseflip.server import protocol as p
from phaseflip.server import tools
from tests import fake_engine
from tests.conftest import build_tokenizer
from tests.test_server_ops import asgi
from tests.test_tool_parsers import (
    MISTRAL_SPECIALS,
    MISTRAL_TEMPLATE,
    NOW,
    OSLO,
    TIME,
    WEATHER,
    _plan,
    _stream,
    _tokens,
)

PARIS = ("get_weather", '{"city": "Paris", "unit": "c"}')
UTC = ("get_time", '{"tz": "UTC"}')
CALLS = {
    "two": ('[get_weather(city="Paris", unit="c"), get_time(tz="UTC")]', [PARIS, UTC]),
    "spaced": ('\n [ get_weather (city="Paris", unit=\'c\') ,get_time(tz="UTC") ]\n',
               [PARIS, UTC]),
    "no_arguments": ("[get_time()]", [NOW]),
    "literals": ('[get_weather(city="Oslo", days=[1, -2, 3.5], opts={"metric": True, '
                 '"x": None}, note="é")]', [("get_weather", '{"city": "Oslo", "days": '
                                            '[1, -2, 3.5], "opts": {"metric": true, "x": '
                                            'null}, "note": "é"}')]),
}
CONTENT = {  # looks like Python, or like a call, and is not one: content, as written
    "a_name": "[get_weather(city=paris)]",
    "a_call_inside": "[get_weather(city=str(1))]",
    "an_import": '[get_weather(city=__import__("os").system("ls"))]',
    "an_operation": '[get_weather(city="a" + "b")]',
    "positional": '[get_weather("Paris")]',
    "splat": '[get_weather(**{"city": "Paris"})]',
    "twice": '[get_weather(city="a", city="b")]',
    "tuple": '[get_weather(city=("a", "b"))]',
    "bytes": '[get_weather(city=b"x")]',
    "infinite": "[get_weather(t=1e999)]",
    "int_keys": '[get_weather(opts={1: "a"})]',
    "unlisted": '[search(q="x")]',
    "one_unlisted": '[get_time(), print("hi")]',
    "attribute": '[os.system("ls")]',
    "comprehension": "[get_time() for _ in range(3)]",
    "text_after": "[get_time()] Done.",
    "text_before": "Calling [get_time()]",
    "no_brackets": "get_time()",
    "empty": "[]",
    "markdown": "[get_weather](https://x) is a tool",
    "too_deep": "[get_time(x=" + "[" * 300 + "]" * 300 + ")]",
}
CASES = {**{k: (t, None, c) for k, (t, c) in CALLS.items()},
         **{k: (t, t, []) for k, t in CONTENT.items()}}


@pytest.mark.parametrize("case", CASES)
def test_pythonic_calls_whole_and_streamed(case) -> None:
    text, content, calls = CASES[case]
    plan = _plan()
    assert tools.parse_output(plan, text) == (content, calls)
    splits = [list(text), _tokens(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in splits:
        for eos in (True, False):
            got, deltas, _ = _stream(plan, pieces, eos)
            assert got == (content or ""), pieces
            assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
                (i, n, a) for i, (n, a) in enumerate(calls)]


@pytest.mark.parametrize(("text", "sent_before_end"), [
    ('[get_weather(city="Pa', ""),
    ("[get_wea", ""),
    (" [ get_time", ""),
    ("[get_weather](x", "[get_weather](x"),
    ("[docs](x)", "[docs](x)"),
    ("[get_weather is", "[get_weather is"),
])
def test_a_stream_holds_back_only_what_may_begin_a_pythonic_call(text, sent_before_end) -> None:
    streamer = tools.ToolStreamer(_plan())
    assert "".join(streamer.feed(ch, False)[0] or "" for ch in text) == sent_before_end


def test_parallel_false_keeps_the_first_pythonic_call() -> None:
    text = CALLS["two"][0]
    one = _plan(parallel_tool_calls=False)
    assert tools.parse_output(one, text) == (None, [PARIS])
    _, deltas, _ = _stream(one, _tokens(text), eos=True)
    assert [(d.index, d.function.name) for d in deltas] == [(0, "get_weather")]


# ------------------------------------------------------------------ Mistral, markers kept
@pytest.fixture(scope="module")
def mistral_tokenizer(tmp_path_factory):
    """A byte-level tokenizer with Mistral's control tokens, `[ARGS]` too, as special tokens,
    and a Mistral-style template."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("mistral_tok")
    build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": [*MISTRAL_SPECIALS, "[ARGS]"]})
    tok.bos_token, tok.eos_token, tok.chat_template = "<s>", "</s>", MISTRAL_TEMPLATE
    return tok


CALL_JSON = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
SCRIPTS = {  # what the model writes (special tokens spelt) -> (content, calls)
    "content_then_call": ("Sure. [TOOL_CALLS]" + CALL_JSON, "Sure.", [OSLO]),
    "call_only": ("[TOOL_CALLS]" + CALL_JSON, None, [OSLO]),
    "args_form": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
                  None, [OSLO, NOW]),
    "other_special_in_content": ("Hi[/INST] there. [TOOL_CALLS]" + CALL_JSON, "Hi there.",
                                 [OSLO]),
    "no_call": ("Hi[/INST] there", "Hi there", []),
    "marker_without_call": ("[TOOL_CALLS] not a call", " not a call", []),
}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]


def _scripted_engine(monkeypatch, tok, script: list[int]) -> dict:
    """Makes the fake engine answer every request with `script` (ending in EOS, as the engine
    ends: its text hidden), decoded as the engine would with the request's
    `skip_special_tokens`, and with the engine's stop-string rule: a suffix that may begin
    one of the request's `stop` strings waits for the next delta (a special token's spelling
    may then arrive in two). Returns the holder its `engine` goes in."""
    holder: dict = {}
    decoders: dict[str, tuple[IncrementalDetokenizer, list[int]]] = {}

    def delta(rid: str, finish: str | None, prompt_len: int, done: int) -> StreamDelta:
        params = next(a.params for a in holder["engine"].added if a.rid == rid)
        detok, sent = decoders.setdefault(rid, (IncrementalDetokenizer(
            tok, [], params.skip_special_tokens), [0]))
        tok_id = script[done - 1]
        if finish is None:
            detok.append([tok_id])
            text = detok.text
            end = max(sent[0], len(text) - partial_stop_len(text, params.stop or []))
            new, sent[0] = text[sent[0]:end], end
            return StreamDelta(rid, 0, new, [tok_id])
        detok.flush()
        return StreamDelta(rid, 0, detok.text[sent[0]:], [tok_id], finish_reason="stop",
                           matched_stop=tok_id, usage=Usage(prompt_len, done, 0))

    monkeypatch.setattr(fake_engine, "_delta", delta)
    monkeypatch.setattr(fake_engine, "tokenizer", lambda: tok)
    return holder


def _chat_stream(lines: list[str]) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, reason = "", {}, None
    for line in lines:
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        content += choice["delta"].get("content") or ""
        for c in choice["delta"].get("tool_calls") or []:
            name, args = calls.get(c["index"], ("", ""))
            fn = c.get("function") or {}
            calls[c["index"]] = (name + (fn.get("name") or ""), args + (fn.get("arguments") or ""))
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _responses_stream(lines: list[str]) -> tuple[str, list[tuple[str, str]]]:
    text, done = "", None
    for line in lines:
        if line.startswith("data: "):
            ev = json.loads(line[6:])
            text += ev.get("delta", "") if ev["type"] == "response.output_text.delta" else ""
            if ev["type"] in ("response.completed", "response.incomplete"):
                done = ev["response"]
    calls = [(o["name"], o["arguments"]) for o in done["output"] if o["type"] == "function_call"]
    return text, calls


def _answers(tmp_path, monkeypatch, tok, written: str, extra: dict | None = None,
             chat_extra: dict | None = None) -> dict:
    """What chat and Responses answer, whole and streamed, when the model writes `written`;
    and the `skip_special_tokens` the engine got. (`chat_extra`: fields for chat only, such
    as `stop`, which Responses has not.)"""
    script = [*tok.encode(written, add_special_tokens=False), tok.convert_tokens_to_ids("</s>")]
    holder = _scripted_engine(monkeypatch, tok, script)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": TOOLS, "max_tokens": len(script), **(extra or {}), **(chat_extra or {})}
    resp = {"model": "tiny", "input": "Weather in Oslo?", "max_output_tokens": len(script),
            "tools": [{"type": "function", **f} for f in (WEATHER, TIME)], **(extra or {})}

    async def go() -> dict:
        async with fake_engine.fake_server(tmp_path, step_s=0.001) as (_, app, engine), \
                asgi(app) as c:
            holder["engine"] = engine
            got: dict = {}
            r = await c.post("/v1/chat/completions", json=chat, timeout=30)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            got["chat"] = (choice["message"]["content"],
                           [(t["function"]["name"], t["function"]["arguments"])
                            for t in choice["message"].get("tool_calls") or []],
                           choice["finish_reason"])
            r = await c.post("/v1/chat/completions", json=chat | {"stream": True}, timeout=30)
            got["chat_stream"] = _chat_stream(r.text.splitlines())
            r = await c.post("/v1/responses", json=resp, timeout=30)
            assert r.status_code == 200, r.text
            out = r.json()["output"]
            got["responses"] = (
                "".join(o["content"][0]["text"] for o in out if o["type"] == "message"),
                [(o["name"], o["arguments"]) for o in out if o["type"] == "function_call"])
            r = await c.post("/v1/responses", json=resp | {"stream": True}, timeout=30)
            got["responses_stream"] = _responses_stream(r.text.splitlines())
            got["skip"] = [a.params.skip_special_tokens for a in engine.added]
            return got

    return asyncio.run(asyncio.wait_for(go(), 60))


@pytest.mark.parametrize("case", SCRIPTS)
def test_mistral_calls_after_content_with_special_tokens_skipped(
        case, tmp_path, monkeypatch, mistral_tokenizer) -> None:
    """The default `skip_special_tokens` took `[TOOL_CALLS]` out of the text, and `Sure.
    [{...}]` was content; decoded with special tokens for the parser, the call is found, and
    the content is what skipping them gives, chat and Responses, whole and streamed."""
    written, content, calls = SCRIPTS[case]
    got = _answers(tmp_path, monkeypatch, mistral_tokenizer, written)
    reason = "tool_calls" if calls else "stop"
    assert got["chat"] == (content, calls, reason)
    assert got["chat_stream"] == (content or "", calls, reason)
    assert got["responses"] == (content or "", calls)
    assert got["responses_stream"] == (content or "", calls)
    assert got["skip"] == [False] * 4


def test_special_tokens_stay_skipped_or_kept_as_asked(tmp_path, monkeypatch,
                                                      mistral_tokenizer) -> None:
    """Without tools in play the text is decoded as asked (skipped by default); with
    `skip_special_tokens: false` the content keeps them all, the markers too."""
    written = "Hi[/INST] there [TOOL_CALLS] no call"
    got = _answers(tmp_path, monkeypatch, mistral_tokenizer, written,
                   {"skip_special_tokens": False})
    assert got["chat"][:2] == (written, []) and got["chat_stream"][:2] == (written, [])
    assert got["skip"] == [False] * 4
    got = _answers(tmp_path, monkeypatch, mistral_tokenizer, written, {"tool_choice": "none"})
    assert got["chat"][:2] == ("Hi there  no call", [])
    assert got["skip"] == [True] * 4


def test_tokenizers_without_the_marker_keep_skipping(tmp_path) -> None:
    """Only a vocabulary whose `[TOOL_CALLS]` is a special token needs it kept."""
    from transformers import AutoTokenizer

    from phaseflip.server.token_text import TokenText

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert not tools.keep_specials(_plan(), TokenText(tok))
    tok.add_tokens(["[TOOL_CALLS]"])  # (in the vocabulary, not special)
    assert not tools.keep_specials(_plan(), TokenText(tok))
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    plan = _plan()
    assert tools.keep_specials(plan, TokenText(tok))
    assert not tools.keep_specials(_plan(tool_choice="required"), TokenText(tok))


UNCARRIABLE = {  # pythonic arguments no response can carry: content, never a 500
    "pythonic_big_int": "[get_weather(city=0x" + "f" * 4000 + ")]",
    "pythonic_surrogate": r'[get_weather(city="\ud800")]',
}
AS_WRITTEN = {  # JSON arguments are sent as the model wrote them, which Python need not load
    "json_big_int": ('{"name": "get_weather", "parameters": {"x": ' + "1" * 5000 + "}}",
                     '{"x": ' + "1" * 5000 + "}"),
    "json_surrogate": (r'{"name": "get_weather", "parameters": {"city": "\ud800"}}',
                       r'{"city": "\ud800"}'),
    "hermes_big_int": ('<tool_call>{"name": "get_weather", "arguments": {"x": '
                       + "1" * 5000 + "}}</tool_call>", '{"x": ' + "1" * 5000 + "}"),
}


@pytest.mark.parametrize("case", UNCARRIABLE)
def test_arguments_no_response_can_carry_stay_content(case) -> None:
    """An int past Python's 4 300-digit limit raised ValueError out of the parser, and a lone
    surrogate (Python's `\\ud800`) reached the response's UTF-8 encoding: a 500."""
    text = UNCARRIABLE[case]
    content, calls = tools.parse_output(_plan(), text)
    assert calls == [] and content == text


@pytest.mark.parametrize("case", AS_WRITTEN)
def test_json_arguments_are_carried_as_written(case) -> None:
    """JSON arguments are the model's text, never loaded and dumped again (which raised for
    these, and made them content): whole, they are what a stream's fragments add up to."""
    text, args = AS_WRITTEN[case]
    content, calls = tools.parse_output(_plan(), text)
    assert (content, calls) == (None, [("get_weather", args)])
    message = p.ChatResponseMessage(content=content, tool_calls=tools.tool_calls(calls))
    assert json.loads(message.model_dump_json())["tool_calls"][0]["function"]["arguments"] == args
