"""Request bodies of phaseflip's native endpoints: `/generate` (in SGLang's shape, its field
names and its switches), `/tokenize`, `/detokenize`, `/abort_request` and `/admin/flip`.

Checked as strictly as the OpenAI bodies (`requests.py`: unknown fields are errors, scalars
are strict); SGLang's fields for features not served are declared so that a client sending
them unset is served and one setting them hears which one is not supported.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, Strict, model_validator

from phaseflip.server.protocol.chat import (
    ChatMessage,
    ToolChoice,
    conversation_size,
    template_kwargs,
)
from phaseflip.server.protocol.requests import (
    Bool,
    Float,
    GrammarText,
    Int,
    LogitBias,
    Seed,
    Stop,
    StopTokenIds,
    Str,
    TokenId,
    Tools,
    TopLogprobsNum,
    _fail,
    _Ids,
    _prompt_validator,
    _Request,
    _Text,
)


def _reject_logprob_keys(data: Any) -> Any:
    if isinstance(data, dict):
        for key in ("logprobs", "prompt_logprobs"):
            if key in data:
                raise _fail(
                    "logprobs are requested with return_logprob / top_logprobs_num / "
                    "logprob_start_len on the request, not in sampling_params",
                    key,
                )
    return data


class NativeSamplingParams(_Request):
    """`sampling_params` of `/generate`: `SamplingParams` field names, types checked here.

    Ranges are left to `SamplingParams.validate`, which the server runs anyway (some limits
    depend on the vocabulary), so the two cannot disagree. A field left out (or null) keeps
    the `SamplingParams` default, except `max_new_tokens` (see `generate_sampling_params`).
    """

    max_new_tokens: Int | None = None
    min_new_tokens: Int | None = None
    temperature: Float | None = None
    top_k: Int | None = None
    top_p: Float | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    frequency_penalty: Float | None = None
    presence_penalty: Float | None = None
    logit_bias: LogitBias = None
    seed: Seed | None = None
    """OpenAI's range, as chat's: the sampler keeps a seed's low 64 bits, so a wider seed
    would draw silently as another (2**64 as 0)."""
    n: Int | None = None
    ignore_eos: Bool | None = None
    stop: Stop = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: Bool | None = None
    include_stop_str_in_output: Bool | None = None
    regex: GrammarText | None = None
    """The output matches this regular expression (grammar-constrained)."""
    ebnf: GrammarText | None = None
    """The output matches this EBNF grammar (GBNF-style, root rule `root`)."""
    json_schema: GrammarText | None = None
    """The output is JSON valid against this schema (given as JSON text, as in SGLang)."""
    # SGLang's names, accepted as its clients send them (see SGLANG_SAMPLING_EXTRAS)
    no_stop_trim: Bool | None = None
    """SGLang's `include_stop_str_in_output`."""
    spaces_between_special_tokens: Bool | None = None
    """Accepted; the fast tokenizers' decoding has no such switch."""
    stop_regex: Str | list[Str] | None = None
    structural_tag: Str | None = None
    custom_params: dict[str, Any] | None = None
    """`stop_regex`, `structural_tag` and `custom_params` are accepted only unset (null)."""

    @model_validator(mode="before")
    @classmethod
    def _no_logprob_keys(cls, data: Any) -> Any:
        return _reject_logprob_keys(data)

    @model_validator(mode="after")
    def _unsupported(self) -> NativeSamplingParams:
        for name in ("stop_regex", "structural_tag", "custom_params"):
            if getattr(self, name) is not None:
                raise _fail(f"{name} is not supported", name)
        return self

    @model_validator(mode="after")
    def _one_grammar(self) -> NativeSamplingParams:
        given = [k for k in ("regex", "ebnf", "json_schema") if getattr(self, k) is not None]
        if len(given) > 1:
            raise _fail(f"at most one of regex, ebnf and json_schema, got {given}", given[1])
        return self


RequestId = Annotated[str, Strict(), Field(min_length=1)]
SGLANG_SAMPLING_EXTRAS = frozenset({"no_stop_trim", "spaces_between_special_tokens",
                                    "stop_regex", "structural_tag", "custom_params"})
"""`NativeSamplingParams` fields that are SGLang's names or switches, not `SamplingParams`'."""


class GenerateRequest(_Request):
    """Body of the native `POST /generate` (SGLang-like).

    Exactly one of `text` / `input_ids`; a list of prompts is a batch. With `return_logprob`,
    each output token gets its logprob and `top_logprobs_num` alternatives; prompt logprobs are
    computed too when `logprob_start_len >= 0` and are reported from that prompt position on
    (-1: none).
    """

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}]})

    text: Annotated[
        _Text | Annotated[list[_Text], Field(min_length=1)] | None,
        _prompt_validator(strings=True, token_ids=False, what="text")
    ] = None
    input_ids: Annotated[
        _Ids | Annotated[list[_Ids], Field(min_length=1)] | None,
        _prompt_validator(strings=False, token_ids=True, what="input_ids"),
    ] = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] = Field(
        default_factory=NativeSamplingParams)
    """One for every prompt, or a list of one per prompt (as SGLang takes them)."""
    stream: Bool = False
    return_logprob: Bool = False
    top_logprobs_num: TopLogprobsNum = 0
    logprob_start_len: Annotated[int, Strict(), Field(ge=-1)] = -1
    return_text_in_logprobs: Bool = False
    """Each logprob entry's third element is its token's text (else null), as SGLang's."""
    rid: RequestId | list[RequestId] | None = None
    """Request id to use (so the client can `/abort` it), or one per prompt; the server makes
    one when None."""
    # SGLang's fields for what is not served: accepted only unset, as its clients send them
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Bool = False
    log_metrics: Bool = True
    """Accepted; the metrics always count every request."""
    stream_options: dict[str, Any] | None = None
    """Accepted; a stream's chunks always carry the token counts."""

    @property
    def single(self) -> bool:
        """One prompt given bare (a string, or one list of ids): the answer is one object."""
        prompt = self.text if self.text is not None else self.input_ids
        return isinstance(prompt, str) or (bool(prompt) and isinstance(prompt[0], int))

    @property
    def num_prompts(self) -> int:
        return 1 if self.single else len(self.text if self.text is not None else self.input_ids)

    def params_of(self, i: int) -> NativeSamplingParams:
        sp = self.sampling_params
        return sp[i] if isinstance(sp, list) else sp

    @model_validator(mode="after")
    def _check_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise _fail("exactly one of text and input_ids is required", "text")
        for name in ("image_data", "audio_data", "video_data", "lora_path",
                     "custom_logit_processor", "session_params", "token_ids_logprob"):
            if getattr(self, name) is not None:
                raise _fail(f"{name} is not supported", name)
        if self.return_hidden_states:
            raise _fail("return_hidden_states is not supported", "return_hidden_states")
        for name in ("sampling_params", "rid"):
            value = getattr(self, name)
            if isinstance(value, list) and self.single:
                raise _fail(f"{name} is a list (one per prompt) but one prompt is given bare",
                            name)
            if isinstance(value, list) and len(value) != self.num_prompts:
                raise _fail(f"{name} has {len(value)} entries for {self.num_prompts} prompts",
                            name)
        if isinstance(self.rid, list) and len(set(self.rid)) != len(self.rid):
            raise _fail("rid has duplicate entries", "rid")
        if not self.return_logprob:
            if self.top_logprobs_num:
                raise _fail("top_logprobs_num requires return_logprob", "top_logprobs_num")
            if self.logprob_start_len != -1:
                raise _fail("logprob_start_len requires return_logprob", "logprob_start_len")
        return self


class TokenizeRequest(_Request):
    """Body of `POST /tokenize`: a raw prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: Str | None = None
    prompt: Str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    """Only for `messages`: end with the assistant turn's opening, as chat requests do."""
    continue_final_message: Bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    """Only for `messages`: as a chat request's, so the count is the chat request's."""
    tools: Tools = None
    tool_choice: ToolChoice = None
    """Only for `messages`: rendered into the prompt as a chat request renders them (not
    with tool_choice "none"), so the count is the chat request's."""

    _conversation_size = conversation_size("messages")

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return template_kwargs(self.continue_final_message, self.chat_template_kwargs)

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise _fail("exactly one of prompt and messages is required", "prompt")
        if self.prompt is not None and (self.tools is not None or self.tool_choice is not None):
            raise _fail("tools and tool_choice are only for messages", "tools")
        return self


class DetokenizeRequest(_Request):
    model: Str | None = None
    tokens: list[TokenId]


class AbortRequest(_Request):
    rid: Str = ""
    abort_all: Bool = False
    """Abort every request in flight (`rid` is then ignored), as SGLang's."""

    @model_validator(mode="after")
    def _named(self) -> AbortRequest:
        if not self.rid and not self.abort_all:
            raise _fail("rid is required (or abort_all: true)", "rid")
        return self


class FlipRequest(_Request):
    """`POST /admin/flip`: the layout to re-lay the same ranks out as."""

    tp_size: Annotated[int, Strict(), Field(ge=1, le=4096)]
    pp_size: Annotated[int, Strict(), Field(ge=1, le=4096)]
