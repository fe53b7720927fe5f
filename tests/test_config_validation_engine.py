"""The offline API's argument errors and --max-model-len against the model's context, on the
embedded model: each is a typed error naming the argument, not an AttributeError from inside."""

from __future__ import annotations

import dataclasses

import pytest

from phaseflip import Engine, SamplingParams
from phaseflip.config import ALLOW_LONG_MAX_MODEL_LEN_ENV, EMBEDDED_MODEL, EngineConfig
from phaseflip.errors import InvalidRequestError
from phaseflip.model.config import ModelConfig

TWO = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    e = Engine(device="cpu", max_total_tokens=2048, log_level="warning")
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def model_cfg() -> ModelConfig:
    return ModelConfig.from_dir(EMBEDDED_MODEL)


def test_max_model_len_past_the_models_context_is_refused(model_cfg, monkeypatch):
    """4096 on a 1024-position model was served: rotary positions it was never trained on."""
    from phaseflip.engine.context_limit import context_limit

    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    assert context_limit(EngineConfig(), model_cfg) == 1024
    assert context_limit(EngineConfig(max_model_len=1024), model_cfg) == 1024
    assert context_limit(EngineConfig(max_model_len=100), model_cfg) == 100
    with pytest.raises(InvalidRequestError, match=r"--max-model-len 4096 exceeds the model's "
                       r"context of 1024 tokens \(max_position_embeddings\)") as e:
        context_limit(EngineConfig(max_model_len=4096), model_cfg)
    assert e.value.param == "max_model_len" and ALLOW_LONG_MAX_MODEL_LEN_ENV in str(e.value)
    monkeypatch.setenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, "1")  # the opt-in, as vLLM's
    assert context_limit(EngineConfig(max_model_len=4096), model_cfg) == 4096


def test_rope_scaling_extends_the_context_max_model_len_may_ask_for(model_cfg, monkeypatch):
    """As vLLM: yarn covers original positions × factor (a config may leave
    max_position_embeddings at the original), linear scales max_position_embeddings. Dynamic
    does not (vLLM's does): our rotary keeps the unscaled frequencies past it."""
    from phaseflip.engine.context_limit import context_limit

    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    for rope_type, original in (("yarn", 1024), ("linear", None), ("dynamic", None)):
        rope = dataclasses.replace(model_cfg.rope, rope_type=rope_type, factor=4.0,
                                   original_max_position_embeddings=original)
        scaled = dataclasses.replace(model_cfg, rope=rope)
        assert context_limit(EngineConfig(), scaled) == 1024  # the default stays the same
        if rope_type == "dynamic":
            with pytest.raises(InvalidRequestError, match="exceeds the model's context of 1024"):
                context_limit(EngineConfig(max_model_len=1025), scaled)
            continue
        assert context_limit(EngineConfig(max_model_len=4096), scaled) == 4096
        with pytest.raises(InvalidRequestError, match=f"{rope_type} rope factor 4"):
            context_limit(EngineConfig(max_model_len=4097), scaled)


def test_an_engine_refuses_a_context_past_the_model_before_loading(monkeypatch):
    from phaseflip.engine import core

    monkeypatch.delenv(ALLOW_LONG_MAX_MODEL_LEN_ENV, raising=False)
    monkeypatch.setattr(core, "build_layout_bundle",
                        lambda *a, **k: pytest.fail("the model loaded for a refused context"))
    with pytest.raises(InvalidRequestError, match="max-model-len 4096 exceeds"):
        Engine(device="cpu", max_model_len=4096)
    with pytest.raises(InvalidRequestError, match="max_model_len=-5: must be >= 1"):
        Engine(device="cpu", max_model_len=-5)  # was a RuntimeError from torch.zeros


@pytest.mark.parametrize("prompts", [None, 123, b"hi", {"a": 1}])
def test_prompts_of_another_type_are_refused_naming_them(prompts):
    from phaseflip.engine.engine import prompt_list

    with pytest.raises(InvalidRequestError, match="prompts must be a string, a list of token "
                       f"ids, or an iterable of either; got {type(prompts).__name__}") as e:
        prompt_list(prompts)
    assert e.value.param == "prompts"


def test_prompts_in_any_iterable():
    from phaseflip.engine.engine import prompt_list

    assert prompt_list("hi") == ["hi"] and prompt_list([1, 2]) == [[1, 2]]
    assert prompt_list(p for p in ("a", [1])) == ["a", [1]]
    assert prompt_list(("a", "b")) == ["a", "b"] and prompt_list([]) == []


def test_params_may_be_a_dict_of_their_fields_and_nothing_else():
    from phaseflip.engine.engine import params_list

    assert params_list({"max_new_tokens": 4}, 2) == [SamplingParams(max_new_tokens=4)] * 2
    assert params_list(None, 1) == [SamplingParams()]
    assert params_list(iter([TWO, {"n": 2}]), 2) == [TWO, SamplingParams(n=2)]
    with pytest.raises(InvalidRequestError, match=r"unknown SamplingParams field\(s\) "
                       r"\['max_tokens'\]"):
        params_list({"max_tokens": 4}, 1)
    for bad in ("x", 4):
        with pytest.raises(InvalidRequestError, match="params must be a SamplingParams or a "
                           f"dict of its fields, got {type(bad).__name__}"):
            params_list(bad, 1)
    with pytest.raises(InvalidRequestError, match="1 prompts but 2 params"):
        params_list([TWO, TWO], 1)


def test_generate_takes_a_generator_and_a_dict(engine):
    outs = engine.generate((p for p in ["hi", [1, 2]]),
                           {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(InvalidRequestError, match="got NoneType"):
        engine.generate(None, TWO, use_tqdm=False)


def test_an_engine_that_is_shut_down_says_so():
    e = Engine(device="cpu", max_total_tokens=2048, log_level="warning")
    e.shutdown()
    for call in (lambda: e.generate("hi", TWO, use_tqdm=False), e.pool_accounting,
                 lambda: e.flip(1, 1)):
        with pytest.raises(RuntimeError, match="the engine is shut down"):
            call()
    e.shutdown()  # twice is fine


@pytest.mark.parametrize("ids", [[True, 3], [1, False], [1, 2.0], [1, -1], [1, 100]])
def test_prompt_ids_are_integers_of_the_vocabulary_and_never_bools(ids):
    """A list of flags is no prompt (`[True, False]` ran as tokens 1 and 0)."""
    from phaseflip.engine.validation import validate_request

    with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
        validate_request(ids, SamplingParams(), vocab_size=100, max_context=100,
                         max_logprobs=5, kv_capacity_tokens=1000, page_size=16)
