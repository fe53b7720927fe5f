"""`START_CAP`: a call's start (from the `{`, `[` or name that opens it to what decides it: the
`{` of its arguments, or what follows an answer's opening `[`) longer than START_CAP characters
is no call, whole and streamed alike; and a stream of such a start costs about the same per
delta however long it runs (a whitespace run after a `[` or `{` was read again whole every
delta: 15 s for 200 000 spaces after a `[`, 4 a delta)."""

from __future__ import annotations

import time

import pytest

from phaseflip.server import tools
from phaseflip.server.tool_parsers import NAME_CAP, START_CAP
from tests.test_tool_parsers import _calls, _plan, _stream, _tokens

PAD = "\0"
"""Where a format's start takes the whitespace that makes it START_CAP characters long."""
# format -> (what comes before the start, the start (its last character decides), the rest)
FORMATS = {
    "hermes": ("Sure.\n<tool_call>", '{\0"name": "get_time", "arguments": {', "}}</tool_call>"),
    "hermes_late": ("<tool_call>\n", '{"name": "get_time",\0"arguments": {', "}}\n</tool_call>"),
    "mistral": ("[TOOL_CALLS] [", '{\0"name": "get_time", "arguments": {', "}}]"),
    "mistral_args": ("[TOOL_CALLS]", "get_time\0[ARGS]{", "}"),
    "mistral_args_skipped": ("", "get_time{\0}", ""),
    "llama": ("", '{\0"name": "get_time", "parameters": {', "}}"),
    "llama_late": ("\n", '{"name":\0"get_time", "parameters": {', "}}"),
    "llama_tag": ("<|python_tag|>", '{\0"name": "get_time", "parameters": {', "}}"),
    "llama_list": ("", "[\0{", '"name": "get_time", "parameters": {}}]'),
    "pythonic": ("", "[\0get_time(", ")]"),
}
SIZES = {"under": START_CAP - 1, "at": START_CAP, "over": START_CAP + 1}


def _text(case: str, size: int, pad: str = " ") -> str:
    before, start, after = FORMATS[case]
    run = (pad * size)[:size - len(start) + 1]
    return before + start.replace(PAD, run) + after


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("case", FORMATS)
def test_a_start_past_the_cap_is_no_call_whole_and_streamed(case, size) -> None:
    """Just under, at and just past the cap: a call (of get_time), then no call (the text is
    content, a Hermes block left out); each stream adds up to the whole answer."""
    text, plan = _text(case, SIZES[size], " \n\t"), _plan()
    content, calls = tools.parse_output(plan, text)
    assert [name for name, _ in calls] == ([] if size == "over" else ["get_time"])
    opened = len(FORMATS[case][0])
    cut = [[text[:i], text[i:]] for i in range(opened + START_CAP - 3, opened + START_CAP + 3)]
    for pieces in [list(text), _tokens(text), [text[i:i + 7] for i in range(0, len(text), 7)],
                   *cut]:
        for eos in (True, False):
            got, deltas, _ = _stream(plan, pieces, eos)
            assert (got, _calls(deltas)) == (content or "", calls), (case, size, len(pieces))


@pytest.mark.parametrize("length", [NAME_CAP, NAME_CAP + 1])
def test_a_name_past_its_cap_is_no_call_in_mistral_args_form(length) -> None:
    """As in a JSON call: after `[TOOL_CALLS]` any name is a call, but not one past NAME_CAP."""
    text, plan = "[TOOL_CALLS]" + "a" * length + "[ARGS]{}", _plan()
    content, calls = tools.parse_output(plan, text)
    assert bool(calls) == (length <= NAME_CAP)
    got, deltas, _ = _stream(plan, [text[i:i + 5] for i in range(0, len(text), 5)], True)
    assert (got, _calls(deltas)) == (content or "", calls)


STARTS = {  # what comes before a long whitespace run
    "list": "[",
    "object": "{",
    "llama_tag": "<|python_tag|>{",
    "llama_key": '{"name"',
    "pythonic_name": "[get_time",
    "hermes": "<tool_call>{",
    "mistral": "[TOOL_CALLS][{",
    "mistral_args": "[TOOL_CALLS]get_time",
    "content": "Hi",
}


@pytest.mark.parametrize("case", STARTS)
def test_a_long_whitespace_run_streams_in_linear_time(case) -> None:
    """200 000 spaces in deltas of 4 characters (a token's): each delta reads at most the cap
    again. Each start took 15 to 24 s before the cap (after content, 3.6 s: a marker was
    searched for over the held-back run each delta); ~0.4 s now, so 3 s holds on a slow
    shared machine. The answer is the whole one's."""
    text, plan = STARTS[case] + " " * 200_000, _plan()
    streamer, got, deltas = tools.ToolStreamer(plan), [], []
    t = time.perf_counter()
    for i in range(0, len(text) + 4, 4):
        content, d = streamer.feed(text[i:i + 4], i >= len(text))
        got.append(content or "")
        deltas += d
    elapsed = time.perf_counter() - t
    assert elapsed < 3.0, f"{elapsed:.1f} s"
    assert ("".join(got), deltas) == (tools.parse_output(plan, text)[0], [])
