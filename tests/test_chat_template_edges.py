"""Edges of chat templating, end-of-generation and special tokens, against what
`transformers` renders and what vLLM/SGLang do, on a tiny Llama-3 style checkpoint: a template
that emits the BOS itself, a tokenizer whose encoder also adds one, `<|eot_id|>` as the
tokenizer's EOS and several EOS ids in generation_config.json.

The template path is checked through `chat_ids` (what chat and `/tokenize` render with) on a
stand-in for the server context; generation through the Python `Engine`.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from phaseflip.errors import InvalidRequestError
from phaseflip.server.openai_api import chat_ids
from tests.conftest import build_model

LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}{% if enable_thinking is defined and not enable_thinking %}"
          "<think>\n\n</think>\n\n{% endif %}")
SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>"]


def build_llama3(out: Path, generation_eos: list[str]) -> Path:
    """The tiny Llama with Llama-3's special tokens, template and BOS-adding encoder;
    generation_config.json lists `generation_eos` (token strings)."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    build_model(out, "llama", vocab_size=336)  # room for the added tokens
    tok = AutoTokenizer.from_pretrained(out)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.bos_token, tok.eos_token, tok.chat_template = "<|begin_of_text|>", "<|eot_id|>", LLAMA3
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tok.save_pretrained(out)
    eos = tok.convert_tokens_to_ids(generation_eos)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos,
                                                            "bos_token_id": bos}))
    return out


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory) -> Path:
    """generation_config.json lists three EOS ids, as Llama-3.1's does."""
    return build_llama3(tmp_path_factory.mktemp("llama3"),
                        ["<|endoftext|>", "<|eom_id|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def tok(llama3_dir):
    from phaseflip.model.loader import load_tokenizer

    return load_tokenizer(llama3_dir)


def render(tok, messages: list[dict], generation_prompt: bool = True, /,
           **kwargs) -> list[int]:
    """`chat_ids` on a stand-in context that runs the pool's work inline; `kwargs` are the
    request's `chat_template_kwargs`."""
    async def in_pool(fn, *args):
        return fn(*args)

    async def encode(text, _what="prompt", add_special_tokens=True):
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    ctx = SimpleNamespace(tokenizer=tok, in_pool=in_pool, encode=encode,
                          check_text_length=lambda *_: None)
    return asyncio.run(chat_ids(ctx, messages, generation_prompt, kwargs))


def hf_ids(tok, messages: list[dict], **kwargs) -> list[int]:
    """transformers' own rendering, tokenised as `apply_chat_template(tokenize=True)` does."""
    kwargs.setdefault("add_generation_prompt", True)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


CONVERSATIONS = {
    "multi-turn with system": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
    "empty content": [{"role": "user", "content": ""}],
    "name field": [{"role": "user", "content": "x", "name": "bob"}],
    "typed special token": [{"role": "user", "content": "a<|eot_id|>b"}],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_ids_are_transformers_tokens_with_one_bos(tok, name):
    """Token for token what transformers renders; the template's BOS is not doubled by the
    encoder's. A special-token string typed in content becomes that special token, as
    transformers (and so vLLM) tokenises it."""
    messages = CONVERSATIONS[name]
    ids = render(tok, messages)
    assert ids == hf_ids(tok, messages)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    if name == "typed special token":
        assert ids.count(tok.eos_token_id) == 2  # the typed one and the template's


def test_chat_ids_without_generation_prompt(tok):
    messages = CONVERSATIONS["multi-turn with system"]
    assert render(tok, messages, False) == hf_ids(tok, messages, add_generation_prompt=False)


def test_chat_template_kwargs_reach_the_template(tok):
    """Qwen3's `enable_thinking=False` and the like are template variables."""
    messages = [{"role": "user", "content": "hi"}]
    ids = render(tok, messages, enable_thinking=False)
    assert ids == hf_ids(tok, messages, enable_thinking=False) != render(tok, messages)


def test_chat_template_kwargs_may_set_the_renderers_options(tok):
    """vLLM lets `chat_template_kwargs` set `add_generation_prompt` and
    `continue_final_message`; passed beside ours they were a TypeError, a 400. `tokenize`
    there is ignored (the server tokenises)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    assert render(tok, messages[:1], add_generation_prompt=False) == hf_ids(
        tok, messages[:1], add_generation_prompt=False)
    cont = render(tok, messages, add_generation_prompt=False, continue_final_message=True)
    assert cont == hf_ids(tok, messages, add_generation_prompt=False,
                          continue_final_message=True)
    assert cont[-1] != tok.eos_token_id
    assert render(tok, messages[:1], tokenize=True) == hf_ids(tok, messages[:1])
    with pytest.raises(InvalidRequestError):  # both at once: transformers' (and vLLM's) 400
        render(tok, messages, continue_final_message=True)


# ------------------------------------------------------------------ end of generation
@pytest.fixture(scope="module")
def engine(llama3_dir):
    from phaseflip import Engine

    e = Engine(str(llama3_dir), device="cpu", dtype="float32", max_total_tokens=2048)
    yield e
    e.shutdown()


def forced(engine, token: int, **params):
    """The one output of a prompt whose every step is pushed to `token` by logit_bias."""
    from phaseflip import SamplingParams

    sp = SamplingParams(temperature=0, max_new_tokens=4, logit_bias={token: 100.0}, **params)
    return engine.generate([[5, 6, 7]], sp, use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("eos", ["<|endoftext|>", "<|eom_id|>", "<|eot_id|>"])
def test_every_generation_config_eos_stops_unless_ignore_eos(engine, tok, eos):
    token = tok.convert_tokens_to_ids(eos)
    out = forced(engine, token)
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [token], "")
    out = forced(engine, token, ignore_eos=True)
    assert (out.finish_reason, out.token_ids) == ("length", [token] * 4)


def test_stop_token_ids_and_skip_special_tokens(engine, tok):
    header = tok.convert_tokens_to_ids("<|start_header_id|>")
    out = forced(engine, header, stop_token_ids=[header])
    assert (out.finish_reason, out.token_ids, out.matched_stop) == ("stop", [header], header)
    assert forced(engine, header).text == ""
    assert forced(engine, header, skip_special_tokens=False).text == "<|start_header_id|>" * 4


def test_tokenizer_eos_is_a_stop_token(tmp_path):
    """vLLM stops at the tokenizer's EOS even where generation_config.json leaves it out
    (a ChatML fine-tune's `<|im_end|>` over its base's `</s>`)."""
    from phaseflip import Engine

    model = build_llama3(tmp_path / "m", ["<|endoftext|>"])
    with Engine(str(model), device="cpu", dtype="float32", max_total_tokens=1024) as e:
        eot = e.tokenizer.eos_token_id
        out = forced(e, eot)
    assert (out.finish_reason, out.token_ids) == ("stop", [eot])


def test_continue_final_message_as_a_request_field(tmp_path):
    """vLLM's top-level `continue_final_message` (was "Unrecognized request argument"), on
    chat and on `/tokenize` (whose count is then the chat request's); with the default
    add_generation_prompt it is a 400 naming it."""
    import asyncio

    from tests.fake_engine import fake_server
    from tests.test_server_ops import asgi

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}

    async def go():
        async with fake_server(tmp_path) as (_, app, _engine), asgi(app) as c:
            return (
                await c.post("/tokenize", json={"messages": messages} | cont),
                await c.post("/tokenize", json={"messages": messages, "add_generation_prompt":
                                                False, "chat_template_kwargs": cont}),
                await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": messages, "max_tokens": 2} | cont),
                await c.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": messages, "max_tokens": 2,
                    "continue_final_message": True}),
            )

    field, kwargs, chat, both = asyncio.run(go())
    assert field.status_code == 200 and field.json() == kwargs.json(), (field.text, kwargs.text)
    assert chat.status_code == 200, chat.text
    assert both.status_code == 400 and both.json()["error"]["param"] == \
        "continue_final_message", both.text
