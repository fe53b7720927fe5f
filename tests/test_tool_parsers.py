"""`tool_choice: "auto"` parsing of what Llama 3.x, Qwen2.5/Qwen3 (Hermes) and Mistral models
write, whole and streamed (at every character boundary and at token-like boundaries), and
the rendering path of a Mistral-style chat template through a real `phaseflip serve` (CPU,
a tiny random checkpoint: its output is random, so the texts parsed here are forced ones)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from phaseflip.server import tools
from phaseflip.server.protocol import ChatCompletionRequest
from tests.conftest import build_model

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
OSLO = ("get_weather", '{"city": "Oslo"}')
ROME = ("get_weather", '{"city": "Rome"}')
NOW = ("get_time", "{}")


def _plan(**body) -> tools.ToolPlan:
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)],
        "tool_choice": "auto", **body})
    return tools.plan_tools(req)


CASES = {
    # Llama 3.1/3.2/3.3 (`<|python_tag|>` is a special token: usually skipped from the text)
    "llama": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [OSLO]),
    "llama_newlines": ('\n\n  {"name": "get_weather", "parameters": {"city": "Oslo"}}\n',
                       None, [OSLO]),
    "llama_tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                  None, [OSLO]),
    "llama_arguments": ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None, [OSLO]),
    "llama_semicolons": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                         '{"name": "get_time", "parameters": {}}', None, [OSLO, NOW]),
    "llama_lines": ('{"name": "get_weather", "parameters": {"city": "Oslo"}}\n'
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
                    [OSLO, ROME]),
    "llama_string_args": ('{"name": "get_weather", "parameters": "{\\"city\\": \\"Oslo\\"}"}',
                          None, [OSLO]),
    # a JSON answer the user asked for is content: no listed tool named
    "json_answer": ('{"name": "Bob", "parameters": {"age": 3}}',
                    '{"name": "Bob", "parameters": {"age": 3}}', []),
    "json_other_keys": ('{"answer": 42, "name": "get_time", "parameters": {}}',
                        '{"answer": 42, "name": "get_time", "parameters": {}}', []),
    "json_list": ('[1, 2, {"name": "get_time"}]', '[1, 2, {"name": "get_time"}]', []),
    # a call is certain once its name and the `{` of its arguments came (a stream sent it):
    # what follows that is no call is left out
    "json_half_calls": ('{"name": "get_time", "parameters": {}}; {"name": "x", "parameters": {}}',
                        None, [NOW]),
    # Qwen2.5 / Qwen3 (Hermes)
    "hermes_many": ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": '
                    '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                    '"arguments": {}}\n</tool_call>\nDone.', "I will check.", [OSLO, NOW]),
    "hermes_string_args": ('<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": '
                           '\\"Oslo\\"}"}\n</tool_call>', None, [OSLO]),
    "hermes_cut": ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
                   '<tool_call>\n{"name": "get_weather", "arguments": {"ci', None,
                   [NOW, ("get_weather", '{"ci')]),  # (cut short: what came)
    "hermes_unlisted": ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>',
                        None, [("search", '{"q": "x"}')]),
    # Mistral v0.3 (`[TOOL_CALLS]` kept with skip_special_tokens false, else skipped)
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {}}]', None, [OSLO, NOW]),
    "mistral_no_space": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
                         None, [OSLO]),
    "mistral_skipped": (' [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                        '{"name": "get_time", "arguments": {}}]', None, [OSLO, NOW]),
    "mistral_content_first": ('Let me look.\n[TOOL_CALLS] [{"name": "get_time", '
                              '"arguments": {}}]', "Let me look.", [NOW]),
    "mistral_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time'
                     '[ARGS]{}', None, [OSLO, NOW]),
    "mistral_args_skipped": ('get_weather{"city": "Oslo"}', None, [OSLO]),
    # content
    "markdown": ("[1] First point, see [docs](x).", "[1] First point, see [docs](x).", []),
    "a_name_in_prose": ("get_weather is a tool.", "get_weather is a tool.", []),
    "html": ("<b>bold</b> text", "<b>bold</b> text", []),
}


def _tokens(text: str) -> list[str]:
    """Token-like pieces: markers whole, words with their leading space, punctuation runs."""
    return re.findall(r"<\|python_tag\|>|\[TOOL_CALLS\]|\[ARGS\]|</?tool_call>|\s?\w+|"
                      r"\s?[^\w\s]+|\s+", text)


def _calls(deltas: list) -> list[tuple[str, str]]:
    """The calls stream deltas add up to: a call's first delta names it, the next ones carry
    fragments of its arguments."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = [d.function.name, ""]
        calls[d.index][1] += d.function.arguments or ""
    return [(name, args) for name, args in calls.values()]


def _stream(plan: tools.ToolPlan, pieces: list[str], eos: bool):
    streamer, content, deltas = tools.ToolStreamer(plan), "", []
    for i, piece in enumerate(pieces):
        c, d = streamer.feed(piece, not eos and i == len(pieces) - 1)
        content += c or ""
        deltas += d
    if eos:  # (a stop token: no text)
        c, d = streamer.feed("", True)
        content += c or ""
        deltas += d
    return content, deltas, streamer


@pytest.mark.parametrize("case", CASES)
def test_auto_parses_what_models_write_whole_and_streamed(case) -> None:
    text, content, calls = CASES[case]
    plan = _plan()
    assert tools.parse_output(plan, text) == (content, calls)
    assert "".join(_tokens(text)) == text
    splits = [list(text), _tokens(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for pieces in splits:
        for eos in (True, False):
            got, deltas, streamer = _stream(plan, pieces, eos)
            assert got == (content or ""), pieces
            assert _calls(deltas) == calls
            assert [d.index for d in deltas if d.id] == list(range(len(calls)))
            assert all(d.type == "function" and d.function.name for d in deltas if d.id)
            assert bool(streamer.calls) == bool(calls)


@pytest.mark.parametrize(("text", "sent_before_end"), [
    ("Let me check. <tool_call>", "Let me check."),
    ("Sure.\n[TOOL_CALLS", "Sure."),
    ("[1] First", "[1] First"),
    ('{"answer": 42', '{"answer": 42'),
    ('{"name": "Bob", "parameters"', '{"name": "Bob", "parameters"'),
    ("get_weather is", "get_weather is"),
    ('{"name": "get_weather", "parameters": ', ""),
    ("get_wea", ""),
    ("<|python", ""),
])
def test_a_stream_holds_back_only_what_may_begin_a_call(text, sent_before_end) -> None:
    """Content goes out as soon as no call can begin with it; what may begin one waits."""
    got, deltas, _ = _stream(_plan(), list(text), eos=False)
    assert deltas == []
    streamer = tools.ToolStreamer(_plan())
    sent = "".join(streamer.feed(ch, False)[0] or "" for ch in text)
    assert sent == sent_before_end


def test_calls_say_tool_calls_have_unique_ids_and_parallel_false_keeps_one() -> None:
    text = CASES["llama_semicolons"][0]
    plan = _plan()
    _, calls = tools.parse_output(plan, text)
    assert plan.finish_reason("stop", True, text) == "tool_calls"
    assert plan.finish_reason("length", True, text) == "length"
    ids = [c.id for c in tools.tool_calls(calls * 50)]
    assert len(set(ids)) == len(ids)
    one = _plan(parallel_tool_calls=False)
    for case in ("llama_semicolons", "hermes_many", "mistral", "mistral_args"):
        text = CASES[case][0]
        assert tools.parse_output(one, text)[1] == CASES[case][2][:1]
        _, deltas, _ = _stream(one, _tokens(text), eos=True)
        assert [(d.index, d.function.name) for d in deltas if d.id] == [
            (0, CASES[case][2][0][0])]


# ------------------------------------------------------------------ Mistral rendering
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] "
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ m.content }}[/INST]"
    "{% elif m.tool_calls is defined and m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{% if c.id is not defined or c.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}{{ (c.function | tojson)[:-1] }}, \"id\": \"{{ c.id }}\"}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'tool' %}{% if m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}[TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": "
    "\"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}")
MISTRAL_SPECIALS = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                    "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_3f2a9c1b7d4e4f0a8b6c2d1e", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_3f2a9c1b7d4e4f0a8b6c2d1e", "content": "rain"},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "noon"},
    {"role": "user", "content": "And now?"},
]


def test_mistral_templates_get_nine_character_call_ids() -> None:
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, "tools": [
        {"type": "function", "function": WEATHER}]})
    msgs, _ = tools.template_messages(req, tools.plan_tools(req), MISTRAL_TEMPLATE)
    first, second = (c["id"] for c in msgs[1]["tool_calls"])
    assert re.fullmatch(r"[0-9a-f]{9}", first) and second == "abcDEF123"
    assert [msgs[2]["tool_call_id"], msgs[3]["tool_call_id"]] == [first, second]
    # other templates keep the ids as sent
    msgs, _ = tools.template_messages(req, tools.plan_tools(req), "{{ m.tool_calls }}{{ tools }}")
    assert msgs[1]["tool_calls"][0]["id"] == HISTORY[1]["tool_calls"][0]["id"]


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    """A real `phaseflip serve` of a tiny Mistral whose tokenizer has Mistral's control tokens
    (special) and a Mistral v0.3-style template that raises on ids not 9 characters long."""
    from transformers import AutoTokenizer

    from tests.server_process import start_server, stop_server

    out: Path = tmp_path_factory.mktemp("mistral")
    build_model(out, "mistral", vocab_size=336, max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIALS})
    tok.bos_token, tok.eos_token, tok.chat_template = "<s>", "</s>", MISTRAL_TEMPLATE
    tok.save_pretrained(out)
    eos = tok.convert_tokens_to_ids("</s>")
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    proc, url = start_server("--model", str(out), "--served-model-name", "tiny-mistral",
                             deadline_s=90)
    try:
        yield url, tok.convert_tokens_to_ids("[TOOL_CALLS]")
    finally:
        stop_server(proc)


def test_a_mistral_conversation_with_openai_call_ids_renders(mistral_server) -> None:
    import httpx

    url, _ = mistral_server
    body = {"model": "tiny-mistral", "messages": HISTORY,
            "tools": [{"type": "function", "function": f} for f in (WEATHER, TIME)]}
    r = httpx.post(url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    text = httpx.post(url + "/detokenize", json={"tokens": r.json()["tokens"]},
                      timeout=30).json()["prompt"]
    nine = tools._mistral_id(HISTORY[1]["tool_calls"][0]["id"])
    assert ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "'
            + nine + '"}') in text
    assert f'"call_id": "{nine}"' in text and '"call_id": "abcDEF123"' in text
    assert text.count("[AVAILABLE_TOOLS]") == 1
    # the answer has the chat shape, streamed and whole alike (greedy)
    body |= {"max_tokens": 8, "temperature": 0}
    whole = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    (choice,) = whole.json()["choices"]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    assert choice["message"]["role"] == "assistant"
    streamed, reasons = "", []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body | {"stream": True},
                      timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])["choices"][0]
                streamed += ch["delta"].get("content") or ""
                reasons.append(ch["finish_reason"])
    assert streamed == (choice["message"]["content"] or "")
    assert reasons[-1] == choice["finish_reason"]


def test_the_text_parsed_skips_the_tool_calls_token_unless_asked(mistral_server) -> None:
    """`[TOOL_CALLS]` is special: under `auto` the text is decoded with the marker kept for the
    parser and the content leaves it out; with `skip_special_tokens: false` the content keeps
    it."""
    import httpx

    url, marker = mistral_server
    body = {"model": "tiny-mistral", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": TIME}], "max_tokens": 2,
            "temperature": 0, "logit_bias": {str(marker): 100}}
    got = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert got["choices"][0]["message"]["content"] == ""
    got = httpx.post(url + "/v1/chat/completions", json=body | {"skip_special_tokens": False},
                     timeout=60).json()
    assert got["choices"][0]["message"]["content"] == "[TOOL_CALLS][TOOL_CALLS]"
