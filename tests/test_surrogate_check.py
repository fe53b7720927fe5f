"""The one lone-surrogate check (`phaseflip.sampling.surrogates`) that the HTTP request models
and the offline `Engine.encode` share: where it finds one, the words both answer with, and that
the engine gets it without importing the server layer (server -> engine -> sampling)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from phaseflip.engine import engine as engine_module
from phaseflip.engine.engine import Engine
from phaseflip.errors import InvalidRequestError
from phaseflip.sampling import surrogates
from phaseflip.sampling.surrogates import find_lone_surrogate, lone_surrogate_problem
from phaseflip.server import protocol as p
from phaseflip.server.protocol import requests as request_models

ENDS = ("\ud800", "\udbff", "\udc00", "\udfff")  # (both halves' first and last)


@pytest.mark.parametrize("text, index", [
    ("", None), ("plain ascii", None), ("héllo wörld 😀 \uffff \U0010ffff", None),
    ("a\ud800b", 1), ("\udcff", 0), ("😀é\udbffx\ud800", 2),
] + [(f"ok{c}", 2) for c in ENDS])
def test_find_lone_surrogate_gives_the_first_index(text, index):
    assert find_lone_surrogate(text) == index


def test_the_problem_names_the_escaped_surrogate_and_its_index():
    assert lone_surrogate_problem("ab\udc80", 2) == (
        "contains a lone surrogate (\\udc80) at character 2; text must be valid Unicode")


def _encode_error(prompt: str) -> InvalidRequestError:
    """`Engine.encode`'s error for `prompt`, without a model (a tokenizer that must not run)."""
    unused = SimpleNamespace(encode=lambda _: pytest.fail("the tokenizer saw a surrogate"))
    with pytest.raises(InvalidRequestError) as e:
        Engine.encode(SimpleNamespace(tokenizer=unused), prompt)
    return e.value


def test_engine_encode_rejects_a_lone_surrogate_with_the_prompt_named():
    err = _encode_error("héllo\udbffx")
    assert err.param == "prompt"
    assert str(err) == ("the prompt contains a lone surrogate (\\udbff) at character 5; "
                        "text must be valid Unicode")
    ok = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda s: [len(s)]))
    assert Engine.encode(ok, "héllo") == [5]


def test_the_http_models_say_the_same_after_the_field_path():
    with pytest.raises(Exception, match="lone surrogate") as e:
        p.GenerateRequest.model_validate({"text": "ok", "sampling_params": {
            "stop": ["x", "é\udc00"]}})
    message, param = p.validation_error_to_openai(e.value)
    assert param == "sampling_params.stop.1"
    assert message == ("sampling_params.stop.1: contains a lone surrogate (\\udc00) at "
                       "character 1; text must be valid Unicode")
    assert str(_encode_error("é\udc00")) == "the prompt " + message.split(": ", 1)[1]


def test_both_layers_use_the_one_helper():
    for module in (engine_module, request_models):
        assert module.find_lone_surrogate is surrogates.find_lone_surrogate, module.__name__
        assert module.lone_surrogate_problem is surrogates.lone_surrogate_problem
        assert not hasattr(module, "_SURROGATE"), f"{module.__name__} keeps its own regex"


def test_the_engine_does_not_import_the_server_layer():
    code = ("import sys, phaseflip.engine.engine; "
            "print([m for m in sys.modules if m.startswith('phaseflip.server')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
