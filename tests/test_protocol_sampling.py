"""How wire requests (completions, chat, the native /generate) map to SamplingParams: defaults,
field by field, and every field reaching the engine (acceptance and refusal:
test_protocol.py)."""

from __future__ import annotations

from typing import Any

import pytest

from phaseflip.sampling.grammar import GrammarSpec
from phaseflip.sampling.params import SamplingParams
from phaseflip.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
    chat_sampling_params,
    completion_sampling_params,
    generate_sampling_params,
    native_sampling_param_names,
)
from phaseflip.server.protocol.native import SGLANG_SAMPLING_EXTRAS
from tests.test_protocol import chat, comp, gen


def test_completion_sampling_params_defaults() -> None:
    p = completion_sampling_params(CompletionRequest.model_validate(comp()), 999)
    assert p == SamplingParams(max_new_tokens=16)
    p = completion_sampling_params(CompletionRequest.model_validate(comp(max_tokens=None)), 999)
    assert p.max_new_tokens == 16  # null on completions is OpenAI's default, not the context


def test_completion_sampling_params_field_by_field() -> None:
    req = CompletionRequest.model_validate(comp(
        max_tokens=40, temperature=0.7, top_p=0.9, n=3, stop="END", presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"7": 5, "12": -100}, seed=42, logprobs=3,
        top_k=0, min_p=0.05, repetition_penalty=1.3, min_tokens=2, ignore_eos=True,
        stop_token_ids=[9], skip_special_tokens=False, include_stop_str_in_output=True))
    p = completion_sampling_params(req, 1000)
    assert p == SamplingParams(
        max_new_tokens=40, min_new_tokens=2, temperature=0.7, top_k=-1, top_p=0.9, min_p=0.05,
        repetition_penalty=1.3, frequency_penalty=-0.5, presence_penalty=0.5,
        logit_bias={7: 5.0, 12: -100.0}, seed=42, n=3, ignore_eos=True, stop=["END"],
        stop_token_ids=[9], logprobs=3, prompt_logprobs=None, skip_special_tokens=False,
        include_stop_str_in_output=True)
    p.validate(vocab_size=100)


@pytest.mark.parametrize(("body", "expected"), [
    (comp(temperature=0), {"temperature": 0.0, "is_greedy": True}),
    (comp(top_k=5), {"top_k": 5}),
    (comp(top_k=0), {"top_k": -1}),
    (comp(stop=["a", "b"]), {"stop": ["a", "b"]}),
    (comp(logit_bias={}), {"logit_bias": None}),
    (comp(echo=True), {"prompt_logprobs": None, "logprobs": None}),
    (comp(echo=True, logprobs=2), {"prompt_logprobs": 2, "logprobs": 2}),
    (comp(echo=True, logprobs=0), {"prompt_logprobs": 0, "logprobs": 0}),
    (comp(logprobs=2), {"prompt_logprobs": None, "logprobs": 2}),
    (comp(n=2, best_of=2), {"n": 2, "logprobs": None}),
    (comp(n=2, best_of=4), {"n": 4, "logprobs": 0}),
    (comp(n=1, best_of=3, logprobs=4), {"n": 3, "logprobs": 4}),
])
def test_completion_sampling_params_mapping(body: dict[str, Any],
                                            expected: dict[str, Any]) -> None:
    p = completion_sampling_params(CompletionRequest.model_validate(body), 100)
    for name, value in expected.items():
        assert getattr(p, name) == value, name


def test_chat_sampling_params_field_by_field() -> None:
    req = ChatCompletionRequest.model_validate(chat(
        max_tokens=5, temperature=0, top_p=0.5, n=2, stop=["x", "y"], presence_penalty=1,
        frequency_penalty=1.5, logit_bias={"3": 1}, seed=7, logprobs=True, top_logprobs=4,
        top_k=10, min_p=0.2, repetition_penalty=0.9, min_tokens=1, ignore_eos=True,
        stop_token_ids=[1, 2], skip_special_tokens=False, include_stop_str_in_output=True))
    assert chat_sampling_params(req, 1000) == SamplingParams(
        max_new_tokens=5, min_new_tokens=1, temperature=0.0, top_k=10, top_p=0.5, min_p=0.2,
        repetition_penalty=0.9, frequency_penalty=1.5, presence_penalty=1.0,
        logit_bias={3: 1.0}, seed=7, n=2, ignore_eos=True, stop=["x", "y"],
        stop_token_ids=[1, 2], logprobs=4, prompt_logprobs=None, skip_special_tokens=False,
        include_stop_str_in_output=True)


@pytest.mark.parametrize(("body", "expected"), [
    (chat(), {"max_new_tokens": 321, "logprobs": None, "n": 1}),
    (chat(max_tokens=4), {"max_new_tokens": 4}),
    (chat(max_completion_tokens=6), {"max_new_tokens": 6}),
    (chat(max_tokens=4, max_completion_tokens=6), {"max_new_tokens": 6}),
    (chat(logprobs=True), {"logprobs": 0, "prompt_logprobs": None}),
    (chat(logprobs=True, top_logprobs=0), {"logprobs": 0}),
    (chat(logprobs=True, top_logprobs=3), {"logprobs": 3}),
    (chat(logprobs=False), {"logprobs": None}),
    (chat(top_k=0), {"top_k": -1}),
    (chat(stop="z"), {"stop": ["z"]}),
])
def test_chat_sampling_params_mapping(body: dict[str, Any], expected: dict[str, Any]) -> None:
    p = chat_sampling_params(ChatCompletionRequest.model_validate(body), 321)
    for name, value in expected.items():
        assert getattr(p, name) == value, name


def test_native_sampling_params_cover_sampling_params() -> None:
    # A field added to SamplingParams must be settable natively (or excluded on purpose).
    assert set(NativeSamplingParams.model_fields) - SGLANG_SAMPLING_EXTRAS == (
        native_sampling_param_names())
    assert "logprobs" not in native_sampling_param_names()
    assert "temperature" in native_sampling_param_names()


@pytest.mark.parametrize(("body", "expected"), [
    (gen(), {"max_new_tokens": 77, "temperature": 1.0, "logprobs": None,
             "prompt_logprobs": None}),
    (gen(sampling_params={"max_new_tokens": 3}), {"max_new_tokens": 3}),
    (gen(sampling_params={"max_new_tokens": None, "temperature": None}),
     {"max_new_tokens": 77, "temperature": 1.0}),
    (gen(sampling_params={"temperature": 0, "top_k": 0, "stop": "x", "n": 2, "seed": 5}),
     {"temperature": 0.0, "top_k": -1, "stop": ["x"], "n": 2, "seed": 5}),
    (gen(sampling_params={"logit_bias": {"4": -1.5}, "stop_token_ids": [2],
                          "min_new_tokens": 1, "ignore_eos": True}),
     {"logit_bias": {4: -1.5}, "stop_token_ids": [2], "min_new_tokens": 1, "ignore_eos": True}),
    (gen(return_logprob=True), {"logprobs": 0, "prompt_logprobs": None}),
    (gen(return_logprob=True, top_logprobs_num=3), {"logprobs": 3, "prompt_logprobs": None}),
    (gen(return_logprob=True, top_logprobs_num=3, logprob_start_len=0),
     {"logprobs": 3, "prompt_logprobs": 3}),
])
def test_generate_sampling_params(body: dict[str, Any], expected: dict[str, Any]) -> None:
    p = generate_sampling_params(GenerateRequest.model_validate(body), 77)
    for name, value in expected.items():
        assert getattr(p, name) == value, name


def test_generate_sampling_params_every_field_reaches_sampling_params() -> None:
    values: dict[str, Any] = {
        "max_new_tokens": 9, "min_new_tokens": 2, "temperature": 0.3, "top_k": 4, "top_p": 0.8,
        "min_p": 0.1, "repetition_penalty": 1.2, "frequency_penalty": 0.4,
        "presence_penalty": -0.4, "logit_bias": {"1": 2.0}, "seed": 3, "n": 2,
        "ignore_eos": True, "stop": ["q"], "stop_token_ids": [5], "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    grammars = {"regex": "[a-z]+", "ebnf": 'root ::= "a"', "json_schema": '{"type": "object"}'}
    assert set(values) | set(grammars) == native_sampling_param_names()
    p = generate_sampling_params(GenerateRequest.model_validate(gen(sampling_params=values)), 1)
    assert p == SamplingParams(**{**values, "logit_bias": {1: 2.0}})
    for kind, text in grammars.items():  # one at a time: NativeSamplingParams refuses two
        body = gen(sampling_params={**values, kind: text})
        p = generate_sampling_params(GenerateRequest.model_validate(body), 1)
        assert p == SamplingParams(**{**values, "logit_bias": {1: 2.0}},
                                   grammar=GrammarSpec(kind, text))
