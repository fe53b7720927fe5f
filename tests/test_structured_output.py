"""Grammar-constrained decoding (sampling/grammar.py) and tool-call parsing (server/tools.py),
below the HTTP layer: the token mask against a tiny grammar, the mask in the sampler, the
engine with constrained and unconstrained rows in one batch, n > 1 and retraction."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import phaseflip
from phaseflip import SamplingParams
from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import GrammarBook, GrammarSpec, apply_bitmask
from phaseflip.scheduler.request import Req
from phaseflip.server import tools
from phaseflip.server.protocol import ChatCompletionRequest

EMBEDDED = Path(phaseflip.__file__).parent / "assets" / "tiny-llama"
VOCAB = 4096
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 3},
}, "required": ["name", "age", "pets"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED)


def _req(spec: GrammarSpec | None, out=()) -> Req:
    return Req(rid="r#0", prompt_ids=[1], params=SamplingParams(grammar=spec), eos_ids=(0,),
               arrival=0, output_ids=list(out))


def _register(book: GrammarBook, req: Req) -> None:
    """`req`'s matcher at once: its grammar compiled first (a miss would compile off the
    caller's thread, `poll` handing the matcher out)."""
    book.compiled(req.params.grammar)
    assert book.register(req)


def _allowed(bitmask_row: torch.Tensor) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_bitmask(logits, [0], bitmask_row.unsqueeze(0))
    return set(torch.nonzero(logits[0] == 0).view(-1).tolist())


def test_mask_allows_exactly_the_tokens_that_continue_the_grammar(tokenizer) -> None:
    words = ("abe", "cde")
    book = GrammarBook(tokenizer, VOCAB)
    req = _req(GrammarSpec("regex", "(ab|cd)e"))
    _register(book, req)
    text = [tokenizer.decode([t]) for t in range(VOCAB)]
    special = set(tokenizer.all_special_ids)
    done = ""
    while done not in words:
        rows, bitmask = book.masks([req])
        expect = {t for t in range(VOCAB) if t not in special and text[t]
                  and any(w.startswith(done + text[t]) for w in words)}
        assert rows == [0] and _allowed(bitmask[0]) == expect, done
        tok = min(expect, key=lambda t: (len(text[t]), t))  # one character at a time
        req.output_ids.append(tok)
        done += text[tok]
    rows, bitmask = book.masks([req])
    assert _allowed(bitmask[0]) == {0}  # complete: only EOS


def test_matcher_follows_output_ids_and_refuses_a_token_outside(tokenizer) -> None:
    book = GrammarBook(tokenizer, VOCAB)
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    req = _req(GrammarSpec("regex", "a+b"), [a, a])
    _register(book, req)
    assert b in _allowed(book.masks([req])[1][0])
    req.output_ids[1:] = []  # cut back (as if the output were rewound): the matcher rolls back
    assert _allowed(book.masks([req])[1][0]) >= {a, b}
    req.output_ids.append(0)  # EOS before the grammar is complete: no mask would allow it
    with pytest.raises(RuntimeError, match="breaks its grammar"):
        book.masks([req])


def test_length_limited_strings_refuse_control_characters() -> None:
    """xgrammar's maxLength strings let control characters through, which strict JSON
    parsers refuse; ours do not (red without the class swap in `_json_grammar`)."""
    from xgrammar.testing import _is_grammar_accept_string

    from phaseflip.sampling.grammar import _build

    grammar = _build(GrammarSpec.json_schema({"type": "string", "maxLength": 5}))
    assert _is_grammar_accept_string(grammar, '"ab c"')
    for bad in ('"a\x00b"', '"a\tb"', '"a\x1fb"', '"a\nb"'):
        assert not _is_grammar_accept_string(grammar, bad), repr(bad)
    assert not _is_grammar_accept_string(grammar, '"abcdef"')


def test_random_weights_answer_strict_json(make_engine) -> None:
    """A random-weight model samples (temperature 1) whatever the mask allows: every answer
    to a schema with length-limited strings parses with json.loads (9 of 16 did not)."""
    engine = make_engine(str(EMBEDDED), load_format="dummy", device="cpu")
    params = SamplingParams(temperature=1.0, max_new_tokens=384, seed=None,
                            grammar=GrammarSpec.json_schema(SCHEMA | {"properties": {
                                **SCHEMA["properties"],
                                "note": {"type": "string", "maxLength": 40}},
                                "required": [*SCHEMA["required"], "note"]}))
    prompts = [[(7 * i + j) % 4000 + 5 for j in range(32)] for i in range(16)]
    for out in engine.generate(prompts, params, use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop", out.text
        json.loads(out.text)


def test_unconstrained_rows_get_no_mask_and_grammars_compile_once(tokenizer) -> None:
    book = GrammarBook(tokenizer, VOCAB)
    plain = _req(None)
    assert book.masks([plain]) is None
    spec = GrammarSpec.json_schema(SCHEMA)
    reqs = [_req(GrammarSpec.json_schema(SCHEMA)) for _ in range(3)]
    assert [book.register(r) for r in reqs] == [False] * 3  # one compile, off this thread
    assert all(r.compiling for r in reqs) and book.masks([plain, *reqs]) is None
    deadline = time.monotonic() + 60
    while book.compiling and time.monotonic() < deadline:
        assert book.poll(0.05) == []
    assert not any(r.compiling for r in reqs)
    assert book.compiles == 1 and book.compiled(spec) is book.compiled(spec)
    rows, bitmask = book.masks([plain, *reqs])
    assert rows == [1, 2, 3] and bitmask.shape == (3, VOCAB // 32)


def test_apply_bitmask_reads_bit_31_and_a_ragged_vocabulary() -> None:
    logits = torch.randn(3, 70)
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = -(2 ** 31)  # bit 31: token 31
    bitmask[0, 1] = 1  # token 32
    bitmask[0, 2] = 1 << 5  # token 69
    bitmask[1, 0] = 1  # token 0
    before = logits.clone()
    apply_bitmask(logits, [2, 0], bitmask)
    assert torch.equal(logits[1], before[1])  # not a constrained row
    assert torch.isfinite(logits[2]).nonzero().view(-1).tolist() == [31, 32, 69]
    assert torch.isfinite(logits[0]).nonzero().view(-1).tolist() == [0]
    # the device path (plain torch), run here on a float64 copy: the same rows survive
    other = before.double()
    apply_bitmask(other, [2, 0], bitmask)
    assert torch.equal(torch.isfinite(other), torch.isfinite(logits))


@pytest.mark.parametrize(("spec", "problem"), [
    (GrammarSpec("json_schema", '{"type": "strin"}'), "strin"),
    (GrammarSpec("json_schema", "[1"), "not JSON"),
    (GrammarSpec("regex", "a(b"), "parenthesis"),
    (GrammarSpec("ebnf", "root ::= foo"), "foo"),
    (GrammarSpec("xml", "x"), "unknown grammar kind"),
])
def test_a_bad_grammar_is_refused_naming_the_problem(spec, problem) -> None:
    with pytest.raises(InvalidRequestError, match=problem):
        SamplingParams(grammar=spec).validate(VOCAB)


def test_min_tokens_with_a_grammar_is_refused() -> None:
    # a complete JSON object allows only EOS, which min_tokens bans: every logit -inf
    params = SamplingParams(grammar=GrammarSpec("json_object"), min_new_tokens=4)
    with pytest.raises(InvalidRequestError, match="min_new_tokens"):
        params.validate(VOCAB)


def test_ignore_eos_with_a_grammar_is_refused() -> None:
    # a complete output allows only EOS; ignored, the next EOS broke the grammar and the
    # engine process exited (one request with both took the server down)
    params = SamplingParams(grammar=GrammarSpec("json_object"), ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        params.validate(VOCAB)


# ------------------------------------------------------------------ the engine
def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (set(obj) == {"name", "age", "pets"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 8 and 0 <= obj["age"] <= 120
            and set(obj["pets"]) <= {"cat", "dog"} and len(obj["pets"]) <= 3)


@pytest.mark.parametrize("cfg", [
    {"overlap_schedule": False},
    {"overlap_schedule": True},
    {"max_total_tokens": 192, "page_size": 4},  # retraction: matchers must stay in step
])
def test_constrained_rows_match_and_other_rows_are_untouched(make_engine, cfg) -> None:
    engine = make_engine(EMBEDDED, **cfg)
    ahead, step_ahead = [], engine.core._step_ahead

    def counted(sink):
        ahead.append(len(engine.core.scheduler.running))
        return step_ahead(sink)

    engine.core._step_ahead = counted
    prompts = ["The answer is", "def f(x):", "Return the", "A list of"]
    greedy = SamplingParams(temperature=0, max_new_tokens=24)
    alone = engine.generate(prompts, greedy, use_tqdm=False)
    spec = GrammarSpec.json_schema(SCHEMA)
    # unseeded: a seed alone would keep them off the overlapped path
    grammar = [SamplingParams(temperature=1.0, n=3, max_new_tokens=80, grammar=spec)
               for _ in prompts]
    mixed = engine.generate(prompts * 2, [greedy] * len(prompts) + grammar, use_tqdm=False)
    for a, b in zip(alone, mixed[: len(prompts)]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for out in mixed[len(prompts):]:
        for s in out.outputs:
            assert s.finish_reason == "stop" and _valid(s.text), s.text
    if "max_total_tokens" in cfg:
        assert engine.core.scheduler.stats.retractions > 0
    # with overlap on, constrained requests keep it (their masks are made while the next
    # step runs): steps with 12 constrained sequences running ran ahead
    assert (max(ahead, default=0) >= 12) == cfg.get("overlap_schedule", True)


# ------------------------------------------------------------------ tool-call parsing
def _plan(**body) -> tools.ToolPlan:
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": fn}], **body})
    return tools.plan_tools(req)


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Sure.", [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
     '"arguments": {"x": 1}}</tool_call>', None, [("a", "{}"), ("b", '{"x": 1}')]),
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", "{}")]),
    ("just text {not json", "just text {not json", []),
    ('<tool_call>{"broken": </tool_call>', '<tool_call>{"broken": </tool_call>', []),
    (' Let me check. \n <tool_call>{"name": "a", "arguments": {}}</tool_call>',
     " Let me check.", [("a", "{}")]),
    ("  ends in spaces  \n", "  ends in spaces  \n", []),
])
@pytest.mark.parametrize("step", [1, 3])
def test_auto_parsers(text, content, calls, step) -> None:
    """Whole and streamed (in pieces of `step` characters) agree: the same calls, and the
    streamed content is the whole answer's content (no whitespace sent before a call that a
    whole answer drops)."""
    plan = _plan(tool_choice="auto")
    assert tools.parse_output(plan, text) == (content, calls)
    streamer, sent, deltas = tools.ToolStreamer(plan), "", []
    for i in range(0, len(text), step):
        c, d = streamer.feed(text[i:i + step], i + step >= len(text))
        sent += c or ""
        deltas += d
    # a call's first delta names it, the later ones carry fragments of its arguments
    streamed: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            streamed[d.index] = [d.function.name, ""]
        streamed[d.index][1] += d.function.arguments or ""
    assert [tuple(c) for c in streamed.values()] == calls
    assert sent == (content or "")


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    plan = _plan(tool_choice="auto", parallel_tool_calls=False)
    assert tools.parse_output(plan, text) == (None, [("a", "{}")])
    deltas = tools.ToolStreamer(plan).feed(text, True)[1]
    assert [(d.index, d.function.name) for d in deltas] == [(0, "a")]
    assert len(tools.parse_output(_plan(tool_choice="auto"), text)[1]) == 2


@pytest.mark.parametrize("eos", [True, False])
@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                  "function": {"name": "get_weather"}}])
def test_constrained_tool_streams_assemble_to_the_whole_answer(choice, eos) -> None:
    """Fed a character at a time, ending with a token of no text (EOS) or with the last
    character itself."""
    plan = _plan(tool_choice=choice)
    args = '{"city": "Bergen \\"west\\" }"}'
    # (the model may put whitespace before the wrapper's closing brace: never streamed)
    text = args if plan.mode == "named" else f'{{"name": "get_weather", "arguments": {args} }}'
    _, whole = tools.parse_output(plan, text)
    assert whole == [("get_weather", args)]
    streamer, got = tools.ToolStreamer(plan), []
    for i, ch in enumerate(text):
        got += streamer.feed(ch, not eos and i == len(text) - 1)[1]
    if eos:
        got += streamer.feed("", True)[1]
    assert got[0].function.name == "get_weather" and got[0].id
    assert "".join(d.function.arguments for d in got) == args


def test_tool_choice_is_checked() -> None:
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        _plan(tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(InvalidRequestError, match="both constrain"):
        _plan(tool_choice="required", response_format={"type": "json_object"})
    assert _plan(tool_choice="none").grammar is None and _plan().mode == "auto"


def test_templates_get_tools_their_way() -> None:
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": history, "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]})
    plan = tools.plan_tools(req)
    # a template that knows tools (Qwen's, Llama 3.1's) gets them as data
    msgs, kwargs = tools.template_messages(req, plan, "{% if tools %}{{ m.tool_calls }}")
    assert kwargs["tools"][0]["function"]["name"] == "get_weather"
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": {"city": "Oslo"}}
    # any other gets a Hermes system prompt and the earlier call as a <tool_call> block
    msgs, kwargs = tools.template_messages(req, plan, "{{ message['content'] }}")
    assert kwargs == {} and msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert msgs[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": '
                                  '{"city": "Oslo"}}\n</tool_call>')


def test_the_front_end_loads_neither_torch_nor_xgrammar_for_a_grammar_spec() -> None:
    # GrammarSpec rides in SamplingParams through the front end, which never loaded torch
    code = ("import sys; import phaseflip.server.app, phaseflip.server.openai_api; "
            "from phaseflip.server import messages as m; from phaseflip.sampling.grammar "
            "import GrammarSpec; from phaseflip import SamplingParams; "
            "m.decode(m.encode(m.AddRequest('r', [1], SamplingParams(grammar=GrammarSpec("
            "'regex', 'a+'))))); print(sorted(x for x in ('torch', 'xgrammar') "
            "if x in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_a_required_call_cut_short_is_the_same_call_streamed_and_whole() -> None:
    """`max_tokens` may end a required call anywhere: whole and streamed agree at every cut
    (the arguments that came, nothing held back at the end; nothing before the name is
    complete), and the whole call loses only the wrapper's brace."""
    plan = _plan(tool_choice="required")
    text = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for cut in range(len(text) + 1):
        part = text[:cut]
        _, calls = tools.parse_output(plan, part)
        streamer, got = tools.ToolStreamer(plan), []
        for ch in part:
            got += streamer.feed(ch, False)[1]
        got += streamer.feed("", True)[1]
        streamed = [(d.function.name, d.function.arguments) for d in got if d.id]
        args = "".join(d.function.arguments or "" for d in got)
        assert [(n, args) for n, _ in streamed] == calls, part
    assert tools.parse_output(plan, text) == (None, [("get_weather", '{"city": "Oslo"}')])
    assert tools.parse_output(plan, text[:-1]) == (None, [("get_weather", '{"city": "Oslo"}')])
    assert tools.parse_output(plan, text[:20]) == (None, [])
