"""Streamed `tool_choice: "auto"` answers: special tokens kept for the parser never reach the
content, whatever deltas their spellings arrive in (`SpecialStripper`); calls go out as
OpenAI streams them, named once certain, then their arguments in fragments (`AutoReader`),
adding up to the whole answer's."""

from __future__ import annotations

import asyncio
import json

import pytest

from phaseflip.server import protocol as p
from phaseflip.server import tools
from phaseflip.server.token_text import SpecialStripper, TokenText
from phaseflip.server.tool_parsers import PARSER_MARKERS
from tests import fake_engine
from tests.test_server_ops import asgi
from tests.test_tool_formats import CASES as PYTHONIC_CASES
from tests.test_tool_formats import (
    TOOLS,
    _answers,
    _scripted_engine,
    mistral_tokenizer,  # noqa: F401 (a fixture)
)
from tests.test_tool_parsers import CASES as PARSER_CASES
from tests.test_tool_parsers import NOW, OSLO, TIME, WEATHER, _plan, _stream, _tokens

CALL = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]'
SPECIALS = {  # what the model writes (special tokens spelt) -> (content, calls)
    "inst_in_content": ("Hi[/INST] there[INST] again", "Hi there again", []),
    "inst_then_call": ("Hi[/INST] there. [TOOL_CALLS]" + CALL, "Hi there.", [OSLO]),
    "args_form": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
                  None, [OSLO, NOW]),
    "looks_like_a_special": ("a [/ b[/INST]c [/INST d [", "a [/ bc [/INST d [", []),
    "ends_in_a_special": ("Done.[/INST]", "Done.", []),
    "a_marker_in_content": ("See[ARGS] this", "See this", []),
}
STOPS = {  # stop strings (never matched here) that hold back part of a spelling
    "none": None,
    "bracket": ["]]"],
    "inside": ["ST]!", "LLS]#", "GS]$"],
}


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize("case", SPECIALS)
def test_no_special_spelling_reaches_the_content(case, stop, tmp_path, monkeypatch,
                                                 mistral_tokenizer) -> None:  # noqa: F811
    """A stop string that may begin with a spelling's last characters (`]]` against `[/INST]`)
    holds them for the next delta: stripped delta by delta, `[/INST` and `]` were content."""
    written, content, calls = SPECIALS[case]
    extra = {} if STOPS[stop] is None else {"stop": STOPS[stop]}  # (Responses has no stop)
    got = _answers(tmp_path, monkeypatch, mistral_tokenizer, written, chat_extra=extra)
    reason = "tool_calls" if calls else "stop"
    assert got["chat"] == (content, calls, reason)
    assert got["chat_stream"] == (content or "", calls, reason)
    assert got["responses"] == (content or "", calls)
    assert got["responses_stream"] == (content or "", calls)


def _strip(tt: TokenText, deltas: list[tuple[str, list[int]]]) -> tuple[str, int]:
    """(what a stripper sends for `deltas`, the most it held at once)."""
    stripper, out, most = SpecialStripper(tt, PARSER_MARKERS), "", 0
    for i, (text, ids) in enumerate(deltas):
        out += stripper.feed(text, ids, i == len(deltas) - 1)
        most = max(most, len(stripper.held))
    return out, most


def test_spellings_split_anywhere_are_stripped(mistral_tokenizer) -> None:  # noqa: F811
    """Ids come with the delta that made them, their text then or later: at every split of
    the text, and with the text lagging the ids by up to 9 characters."""
    tok, tt = mistral_tokenizer, TokenText(mistral_tokenizer)
    written = "Hi[/INST] [/ x[INST][TOOL_CALLS]y</s>z [/INST"
    ids = tok.encode(written, add_special_tokens=False)
    expected = "Hi [/ x[TOOL_CALLS]yz [/INST"
    for i in range(len(written) + 1):
        assert _strip(tt, [(written[:i], ids), (written[i:], [])])[0] == expected, i
    pieces = [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert "".join(pieces) == written
    for lag in range(10):
        deltas, sent = [], 0
        for k, t in enumerate(ids):
            end = max(sent, len("".join(pieces[:k + 1])) - lag)
            deltas.append((written[sent:end], [t]))
            sent = end
        deltas.append((written[sent:], []))
        out, most = _strip(tt, deltas)
        assert out == expected, lag
        assert most < len("[/AVAILABLE_TOOLS]")


def test_a_spelling_never_seen_holds_nothing_for_long(mistral_tokenizer) -> None:  # noqa: F811
    """A special whose decoded text is not its spelling stays owed; it holds back only what may
    still become it, so later specials are still stripped and a literal `[/` arrives when it
    cannot be one (or at the end)."""
    tt = TokenText(mistral_tokenizer)
    inst = mistral_tokenizer.convert_tokens_to_ids("[/INST]")
    begin = mistral_tokenizer.convert_tokens_to_ids("[INST]")
    stripper = SpecialStripper(tt, PARSER_MARKERS)
    assert stripper.feed("a", [inst]) == "a"  # (its text never comes)
    assert stripper.feed(" [/", [7]) == " "
    assert stripper.feed("x [INST]", [begin]) == "[/x "
    assert stripper.feed("b [/", [7]) == "b "
    assert stripper.feed("", [], finished=True) == "[/"


# ------------------------------------------------------------------ calls as they come
def _merged(deltas: list) -> list[tuple[str, str]]:
    """The calls `deltas` add up to, checking their shape: each call's first delta (and only
    it) names it, with an id and type "function", before any other of its deltas and after
    the last of the call before it."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        assert (d.id is not None) == (d.index not in calls), d
        if d.id is not None:
            assert d.index == len(calls) and d.type == "function" and d.function.name
            calls[d.index] = [d.function.name, d.function.arguments or ""]
        else:
            assert d.index == len(calls) - 1 and d.function.name is None and d.type is None
            calls[d.index][1] += d.function.arguments
    return [(n, a) for n, a in calls.values()]


FORMATS = {**{k: v[0] for k, v in PARSER_CASES.items()},
           **{f"pythonic_{k}": v[0] for k, v in PYTHONIC_CASES.items()}}


@pytest.mark.parametrize("case", FORMATS)
def test_a_stream_adds_up_to_the_whole_answer(case) -> None:
    """At every split of what each format's model writes, the streamed content and the calls
    its deltas add up to are the whole answer's; an answer that is no call sends no call
    delta at all."""
    text, plan = FORMATS[case], _plan()
    content, calls = tools.parse_output(plan, text)
    splits = [list(text), _tokens(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in splits:
        for eos in (True, False):
            got, deltas, streamer = _stream(plan, pieces, eos)
            assert (got, _merged(deltas)) == (content or "", calls), pieces
            assert len({d.id for d in deltas if d.id}) == len(calls)


def test_calls_are_kept_from_when_they_are_certain() -> None:
    """Once a call's name and the `{` of its arguments came it is a call: Llama-3 calls after
    it that are not calls, or a Hermes block cut short, no longer make the answer content (or
    drop the call) after its deltas went out."""
    plan = _plan()
    assert tools.parse_output(plan, PARSER_CASES["json_half_calls"][0]) == (None, [NOW])
    assert tools.parse_output(plan, PARSER_CASES["hermes_cut"][0]) == (
        None, [NOW, ("get_weather", '{"ci')])
    cut = '{"name": "get_weather", "parameters": {"ci'
    assert tools.parse_output(plan, cut) == (None, [("get_weather", '{"ci')])
    assert plan.finish_reason("stop", True, cut) == "stop"  # (not whole: not to be run)
    assert plan.finish_reason("length", True, cut) == "length"
    assert plan.finish_reason("stop", True, cut + 'ty": "Oslo"}}') == "tool_calls"
    # braces closed, but not JSON: not to be run either
    assert plan.finish_reason("stop", True, cut + '"}}') == "stop"


INCREMENTAL = {  # (text, where the call is certain: its name goes out there)
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
              "</tool_call>",
    "llama": '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "llama_tag": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    "mistral": 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    "mistral_skipped": ' [{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
    "mistral_args": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
    "mistral_args_skipped": 'get_weather{"city": "Oslo"}',
}


@pytest.mark.parametrize("case", INCREMENTAL)
def test_json_calls_are_named_at_their_brace_and_stream_their_arguments(case) -> None:
    """Character by character: nothing of the call before the `{` of its arguments, its name
    with that `{`, then each character of the arguments as it comes. (A bare `name{`, with no
    marker, is certain one character later: only `{"` or `{}` opens a call there.)"""
    text = INCREMENTAL[case]
    brace = text.index('{"city"')
    certain = brace + (case == "mistral_args_skipped")
    streamer, content, deltas = tools.ToolStreamer(_plan()), "", []
    for i, ch in enumerate(text):
        c, d = streamer.feed(ch, False)
        content, deltas = content + (c or ""), deltas + d
        if i < certain:
            assert deltas == [], text[:i + 1]
        else:
            assert _merged(deltas) == [("get_weather", text[brace:i + 1][:len(OSLO[1])])]
    assert content == ("Sure." if "Sure." in text else "")
    assert len(deltas) == len(OSLO[1]) - (certain - brace)  # (its first delta: `{"` both)


def test_pythonic_calls_come_whole_at_the_end() -> None:
    text = '[get_weather(city="Oslo")]'
    streamer = tools.ToolStreamer(_plan())
    assert all(streamer.feed(ch, False) == (None, []) for ch in text)
    assert _merged(streamer.feed("", True)[1]) == [OSLO]


def _lines(tmp_path, monkeypatch, tok, written: str) -> dict[str, list[dict]]:
    """The chunks of a streamed chat answer and the events of a streamed Responses one."""
    script = [*tok.encode(written, add_special_tokens=False), tok.convert_tokens_to_ids("</s>")]
    holder = _scripted_engine(monkeypatch, tok, script)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": TOOLS, "max_tokens": len(script), "stream": True}
    resp = {"model": "tiny", "input": "Weather in Oslo?", "max_output_tokens": len(script),
            "tools": [{"type": "function", **f} for f in (WEATHER, TIME)], "stream": True}

    async def go() -> dict:
        async with fake_engine.fake_server(tmp_path, step_s=0.001) as (_, app, engine), \
                asgi(app) as c:
            holder["engine"] = engine
            got = {}
            for key, path, body in (("chat", "/v1/chat/completions", chat),
                                    ("responses", "/v1/responses", resp)):
                r = await c.post(path, json=body, timeout=30)
                got[key] = [json.loads(line[6:]) for line in r.text.splitlines()
                            if line.startswith("data: {")]
            return got

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_chat_and_responses_stream_a_call_in_pieces(tmp_path, monkeypatch,
                                                    mistral_tokenizer) -> None:  # noqa: F811
    """Through the server, token by token: chat sends the call's name first and its arguments
    in several chunks, after the content; Responses sends `function_call_arguments.delta`s."""
    written = ('Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", '
               '"days": [1, 2, 3]}}</tool_call>')
    args = '{"city": "Oslo", "days": [1, 2, 3]}'
    got = _lines(tmp_path, monkeypatch, mistral_tokenizer, written)
    deltas = [ch["choices"][0]["delta"] for ch in got["chat"] if ch["choices"]]
    calls = [p.DeltaToolCall.model_validate(c) for d in deltas for c in d.get("tool_calls") or []]
    assert _merged(calls) == [("get_weather", args)] and len(calls) > 3
    first = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert "".join(d.get("content") or "" for d in deltas[:first]) == "Let me look."
    assert not any(d.get("content") for d in deltas[first:])
    assert got["chat"][-1]["choices"][0]["finish_reason"] == "tool_calls"
    pieces = [e["delta"] for e in got["responses"]
              if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(pieces) == args and len(pieces) > 3
    done = got["responses"][-1]["response"]["output"]
    assert [(o["type"], o.get("arguments")) for o in done] == [
        ("message", None), ("function_call", args)]
