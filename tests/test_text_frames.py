"""A stream's plain-text chunks come from frames (`openai_api.TextFrames`): the bytes must be
exactly those of the chunk's pydantic model, for any text, at any choice index."""

from __future__ import annotations

from phaseflip.server import protocol as p
from phaseflip.server.sse import TextFrames, arguments_only, sse

TEXTS = ["", " hello", 'quote " and \\ backslash', "new\nline\ttab\r\x00\x1f\x7f",
         "é ß 中文 😀 \u2028\u2029 \ufeff", "phaseflip-text-mark", '"phaseflip-text-mark"',
         "".join(chr(c) for c in range(0, 0x800))]


def _chat(index: int, text: str) -> p.ChatCompletionStreamResponse:
    return p.ChatCompletionStreamResponse(
        id="chatcmpl-1", created=7, model="m",
        choices=[p.ChatCompletionStreamChoice(index=index, delta=p.DeltaMessage(content=text))])


def _completion(index: int, text: str) -> p.CompletionStreamResponse:
    return p.CompletionStreamResponse(id="cmpl-1", created=7, model="m",
                                      choices=[p.CompletionChoice(index=index, text=text)])


def test_a_framed_chunk_is_the_models_chunk_byte_for_byte():
    """Red with the text written by `json.dumps` with its default ASCII escapes, or with a
    frame shared across choice indexes."""
    for build in (_chat, _completion):
        frames = TextFrames(build)
        for index in (0, 3, 0):
            for text in TEXTS:
                assert frames(index, text) == sse(build(index, text)), (build, index, text)


def test_a_model_name_holding_the_mark_falls_back_to_the_model():
    def build(index: int, text: str) -> p.CompletionStreamResponse:
        return p.CompletionStreamResponse(id="cmpl-1", created=7, model="phaseflip-text-mark",
                                          choices=[p.CompletionChoice(index=index, text=text)])

    frames = TextFrames(build)
    assert frames(0, "x") == sse(build(0, "x")) and frames.frames == {0: None}


def _fragment(key: tuple[int, int], text: str) -> p.ChatCompletionStreamResponse:
    return p.ChatCompletionStreamResponse(
        id="chatcmpl-1", created=7, model="m",
        choices=[p.ChatCompletionStreamChoice(index=key[0], delta=p.DeltaMessage(
            tool_calls=[p.DeltaToolCall(index=key[1],
                                        function=p.DeltaFunctionCall(arguments=text))]))])


def test_a_framed_argument_fragment_is_the_models_chunk_byte_for_byte():
    frames = TextFrames(_fragment)
    for key in ((0, 0), (0, 2), (1, 0), (0, 0)):
        for text in TEXTS:
            assert frames(key, text) == sse(_fragment(key, text)), (key, text)


def test_only_a_bare_argument_fragment_takes_the_frame():
    """A call's first delta names it (id, type, name): never framed as a fragment."""
    bare = p.DeltaToolCall(index=1, function=p.DeltaFunctionCall(arguments='"ci'))
    first = p.DeltaToolCall(index=1, id="call_1", type="function",
                            function=p.DeltaFunctionCall(name="f", arguments=""))
    assert arguments_only(bare) == '"ci'
    assert arguments_only(first) is None
    assert arguments_only(p.DeltaToolCall(index=0)) is None
