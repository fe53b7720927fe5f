"""A real `phaseflip serve` subprocess on a loopback port, driven by the `openai` client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from phaseflip import Engine, SamplingParams
from tests.server_process import start_server, stop_server

MODEL = "tiny-llama"


def idle_accounting(url: str, deadline_s: float = 10) -> dict:
    """Waits until the engine is idle; returns its pool accounting."""
    end = time.monotonic() + deadline_s
    while True:
        info = httpx.get(url + "/server_info").json()
        if info["running"] == 0 and info["waiting"] == 0 or time.monotonic() > end:
            return info


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nope")
    assert err.value.body["code"] == "model_not_found"


def test_the_front_end_froze_its_heap_and_times_its_collector(client, server):
    """The serving process moves its import heap out of the collector's reach once started
    (full passes walked it: ~200 ms stalls of every stream) and exports each pass's time."""
    client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    text = httpx.get(server + "/metrics").text
    frozen = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("phaseflip_frontend_gc_frozen_objects{")]
    assert frozen and frozen[0] > 50_000, frozen
    assert "phaseflip_frontend_gc_pause_seconds_bucket{" in text


def test_greedy_equals_offline_engine(client):
    prompts = ["Return the", "def main():", "If the file does not exist,"]
    with Engine(device="cpu") as engine:
        offline = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12),
                                  use_tqdm=False)
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        o.text for o in offline]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What does os.path.join do?"}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content


def test_list_prompts_with_echo_and_logprobs(client):
    prompts = ["Return the value", "The default"]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    assert len(got.choices) == 2
    for c, prompt in zip(sorted(got.choices, key=lambda c: c.index), prompts):
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert lp.token_logprobs[0] is None  # the first prompt token has no logprob
        assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset)
        assert "".join(lp.tokens).startswith(c.text)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        assert all(len(t) <= 3 for t in lp.top_logprobs[1:])  # top-2 and the chosen token
        assert all(tok in t for tok, t in zip(lp.tokens[1:], lp.top_logprobs[1:]) if tok)
    assert got.usage.prompt_tokens == sum(
        len(httpx.post(f"{client.base_url}".replace("/v1/", "") + "/tokenize",
                       json={"prompt": p}).json()["tokens"]) for p in prompts)


def test_max_tokens_zero_with_echo_scores_prompt(client):
    got = client.completions.create(model=MODEL, prompt="Return the value of x", max_tokens=0,
                                    echo=True, logprobs=0)
    c = got.choices[0]
    assert c.text == "Return the value of x" and got.usage.completion_tokens == 0
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.token_logprobs[-1] < 0


def test_streaming_n_choices_and_usage(client):
    stream = client.completions.create(model=MODEL, prompt="Return the", max_tokens=5, n=3,
                                       temperature=1.0, seed=3, stream=True,
                                       stream_options={"include_usage": True})
    texts, finished, usage = {}, set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2}
    assert usage.completion_tokens == 15 and usage.prompt_tokens == 2
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4, n=2,
        stream=True, stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    roles, content, usage = set(), {0: "", 1: ""}, None
    for chunk in chat:
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.role:
                roles.add(c.index)
            content[c.index] += c.delta.content or ""
    assert roles == {0, 1} and all(content.values())
    assert usage.completion_tokens == 8


def test_best_of_ranks_by_logprob_per_token():
    from phaseflip.server.openai_api import Choice, best_of

    short, long = Choice(0, logprobs=[-5.0, -5.2]), Choice(1, logprobs=[-3.0] * 4)
    assert best_of([short, long], 1) == [long]  # -3 a token beats -5.1, not -12 vs -10.2


def test_streamed_echo_logprobs_give_every_choice_its_prompt(client):
    """The engine sends a prompt's logprobs once, with choice 0; a streamed answer with echo
    gives every choice the prompt's tokens, logprobs and offsets, as the whole answer does."""
    for max_tokens in (3, 0):
        kwargs = {"model": MODEL, "prompt": "Return the value", "max_tokens": max_tokens,
                  "n": 2, "seed": 5, "echo": True, "logprobs": 1}
        whole = {c.index: c for c in client.completions.create(**kwargs).choices}
        text = {0: "", 1: ""}
        tokens, offsets, lps = ({0: [], 1: []} for _ in range(3))
        for chunk in client.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                text[c.index] += c.text
                tokens[c.index] += c.logprobs.tokens
                offsets[c.index] += c.logprobs.text_offset
                lps[c.index] += c.logprobs.token_logprobs
        for i in (0, 1):
            assert text[i] == whole[i].text and tokens[i] == whole[i].logprobs.tokens
            assert offsets[i] == whole[i].logprobs.text_offset
            assert lps[i] == pytest.approx(whole[i].logprobs.token_logprobs)


def test_errors_name_the_field_the_client_sent(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=100000)
    assert err.value.body["param"] == "max_completion_tokens"
    assert "max_completion_tokens" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"min_tokens": 2, "response_format": {
                                      "type": "json_object"}})
    assert err.value.body["param"] == "min_tokens" and "min_tokens cannot" in err.value.body[
        "message"]


def test_best_of_keeps_the_most_likely(client):
    got = client.completions.create(model=MODEL, prompt="Return the", max_tokens=4, n=1,
                                    best_of=3, temperature=1.0, seed=5)
    assert len(got.choices) == 1 and got.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=3, best_of=2)


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 100000}, "max_tokens"),
    ({"suffix": "tail"}, "suffix"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": ""}, "prompt"),
])
def test_bad_completion_requests_are_400(client, kwargs, param):
    kwargs = {"model": MODEL, "prompt": "Return", "max_tokens": 2} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**kwargs)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["message"]
    assert body["param"] is not None and param in body["param"]


def test_context_length_error_says_by_how_much(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="Return the", max_tokens=1030)
    assert err.value.body["code"] == "context_length_exceeded"
    assert "8 too many" in err.value.body["message"]


def test_unsupported_chat_features_are_400(client):
    # (tools and response_format are served: tests/test_structured_server.py)
    for extra in ({"functions": [{"name": "f"}]}, {"function_call": {"name": "f"}}):
        with pytest.raises(openai.BadRequestError, match="not supported"):
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], **extra)


def test_error_shape_for_bad_json_and_request_id(server):
    r = httpx.post(server + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json", "x-request-id": "abc"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.headers["x-request-id"] == "abc"
    assert httpx.get(server + "/nope").status_code == 404


def test_native_endpoints(server):
    tok = httpx.post(server + "/tokenize", json={"prompt": "Return the value"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(server + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Return the value"
    gen = httpx.post(server + "/generate", json={
        "input_ids": tok["tokens"], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True}).json()
    assert len(gen["output_ids"]) == 4 and len(gen["meta_info"]["output_token_logprobs"]) == 4
    assert httpx.get(server + "/health_generate").status_code == 200
    assert httpx.post(server + "/flush_cache").status_code == 200
    assert httpx.get(server + "/flush_cache").status_code == 200  # (SGLang's names and verbs)
    assert httpx.get(server + "/get_model_info").json()["is_generation"] is True
    assert httpx.get(server + "/get_server_info").json()["model"] == MODEL
    metrics = httpx.get(server + "/metrics").text
    for name in ("phaseflip_num_requests_running", "phaseflip_time_to_first_token_seconds",
                 "phaseflip_generation_tokens_total", "phaseflip_cache_hit_rate"):
        assert name in metrics
    info = httpx.get(server + "/server_info").json()
    assert info["pool"]["balanced"] and info["versions"]["phaseflip"]
    assert info["busy_s"] > 0  # seconds inside steps: this test's requests ran some
    # what the weights and the cache run in, as resolved (not only the flags)
    assert info["numerics"] == {"dtype": "float32", "kv_cache_dtype": "float32",
                                "quantization": None}


def generation_tokens(url: str) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith("phaseflip_generation_tokens_total{"))
    return float(line.rsplit(" ", 1)[1])


def test_generate_speaks_sglang(server):
    """The native /generate in SGLang's shape: finish reasons as objects, logprob entries
    `[logprob, id, text|None]`, prompt tops, per-prompt sampling params, the default of 128
    new tokens, SGLang's frontend's own payload, and a batch stream told apart by `index`."""
    def post(body):
        r = httpx.post(server + "/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    out = post({"text": "Return the", "sampling_params": {"max_new_tokens": 3,
                "ignore_eos": True}, "return_logprob": True, "top_logprobs_num": 2,
                "logprob_start_len": 0, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    lp, tid, text = meta["output_token_logprobs"][0]
    assert lp <= 0 and tid == out["output_ids"][0] and isinstance(text, str)
    assert meta["input_token_logprobs"][0][0] is None  # the first prompt token has none
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])
    plain = post({"text": "Return the", "sampling_params": {"max_new_tokens": 2},
                  "return_logprob": True})["meta_info"]
    assert plain["input_token_logprobs"] == [] and plain["output_token_logprobs"][0][2] is None
    stop = post({"text": "Return the", "sampling_params": {"temperature": 0, "stop": ["e"],
                 "max_new_tokens": 40}})["meta_info"]["finish_reason"]
    assert stop in ({"type": "stop", "matched": "e"}, {"type": "length", "length": 40})
    assert post({"text": "Hi", "sampling_params": {"ignore_eos": True}})["meta_info"][
        "completion_tokens"] == 128
    two = post({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1, "ignore_eos":
                True}, {"max_new_tokens": 2, "ignore_eos": True}], "rid": ["r-a", "r-b"]})
    assert [(o["meta_info"]["id"], o["meta_info"]["completion_tokens"]) for o in two] == [
        ("r-a", 1), ("r-b", 2)]
    frontend = {"text": "Q: hi\nA:", "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True,
        "max_new_tokens": 4, "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": None,
        "stop_regex": None, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
        "json_schema": None}, "image_data": None, "lora_path": None}
    assert post(frontend)["meta_info"]["completion_tokens"] <= 4
    chunks = []
    with httpx.stream("POST", server + "/generate", timeout=60, json={
            "text": ["a", "b"], "stream": True,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    last = {c["index"]: c for c in chunks}
    assert sorted(last) == [0, 1] and all(len(c["output_ids"]) == 3 for c in last.values())
    r = httpx.post(server + "/generate", json={"text": "ab", "return_logprob": True,
                                               "logprob_start_len": 50})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len"


def test_generate_stream_says_cached_tokens_from_its_first_chunk(server):
    """SGLang's stream carries the prefix cache's share in every chunk's meta_info, not 0
    until the last (a client watching cache hits reads the first chunk)."""
    body = {"text": "The cached prefix of this prompt " * 6,
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    assert httpx.post(server + "/generate", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", server + "/generate", timeout=60,
                      json=body | {"stream": True}) as r:
        metas = [json.loads(line[6:])["meta_info"] for line in r.iter_lines()
                 if line.startswith("data: {")]
    cached = [m["cached_tokens"] for m in metas]
    assert cached[-1] > 0 and cached == [cached[-1]] * len(cached), cached


def test_abort_all(server):
    body = {"text": "Tell", "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            call = asyncio.create_task(c.post("/generate", json=body))
            while not (await c.get("/server_info")).json()["running"]:
                await asyncio.sleep(0.05)
            r = await c.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200 and len(r.json()["aborted"]) == 1
            return (await call).json()

    assert asyncio.run(main())["meta_info"]["finish_reason"]["type"] == "abort"


def test_disconnect_aborts_and_frees_kv(server):
    body = {"model": MODEL, "prompt": "Return the", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    before, received = generation_tokens(server), 0
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            received += line.startswith("data: ")
            if received > 3:
                break  # hang up mid-stream
    info = idle_accounting(server)
    # the tokens it was sent count as generated, though it never finished
    assert generation_tokens(server) - before >= received
    assert info["running"] == 0, info
    pool = info["pool"]
    assert pool["balanced"] and pool["private"] == 0 and pool["protected"] == 0
    assert info["scheduler"]["decode_tokens"] < 900  # it really stopped early


def test_concurrent_clients_all_answered(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
        async def one(i):
            if i % 2:
                r = await client.completions.create(model=MODEL, prompt=f"Return {i}",
                                                    max_tokens=6, temperature=0)
                return r.choices[0].text
            s = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=6,
                stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
        return await asyncio.gather(*(one(i) for i in range(32)))

    outs = asyncio.run(main())
    assert len(outs) == 32 and all(isinstance(o, str) for o in outs)
    info = idle_accounting(server)
    assert info["pool"]["balanced"] and info["pool"]["private"] == 0


def test_error_inside_a_stream_is_an_event():
    """An error after the stream started is sent as an error event, then [DONE]."""
    from phaseflip.errors import ContextLengthError
    from phaseflip.server.openai_api import stream_response

    async def events():
        yield "data: {}\n\n"
        raise ContextLengthError("too long by 3", "max_tokens")

    async def collect():
        return [c async for c in stream_response(events()).body_iterator]

    out = asyncio.run(collect())
    assert out[0] == "data: {}\n\n" and out[-1] == "data: [DONE]\n\n"
    err = json.loads(out[1].removeprefix("data: "))["error"]
    assert err["message"] == "too long by 3" and err["param"] == "max_tokens"
    assert err["type"] == "invalid_request_error"


def test_api_key_and_queue_bound():
    proc, url = start_server("--api-key", "sekret", "--max-queued-requests", "1")
    try:
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.models.list().data[0].id == MODEL
        flip = {"tp_size": 1, "pp_size": 1}  # the admin API is behind the key too
        assert httpx.post(url + "/admin/flip", json=flip, timeout=30).status_code == 401
        assert httpx.post(url + "/admin/flip", json=flip, timeout=30,
                          headers={"authorization": "Bearer sekret"}).status_code == 400
        assert httpx.post(url + "/admin/flip", json=flip, timeout=30,  # any case of scheme
                          headers={"authorization": "bearer sekret"}).status_code == 400

        async def burst():
            c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
            return await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=f"Return {i}", max_tokens=300,
                                     extra_body={"ignore_eos": True}) for i in range(8)),
                return_exceptions=True)

        results = asyncio.run(burst())
        refused = [r for r in results if isinstance(r, openai.InternalServerError)]
        assert refused and all(r.status_code == 503 for r in refused)
        assert len(refused) < len(results)  # the first one was served
    finally:
        stop_server(proc)


def test_dead_engine_makes_server_exit():
    proc, url = start_server()
    try:
        children = subprocess.check_output(["pgrep", "-P", str(proc.pid)]).split()
        engine_pid = next(  # not multiprocessing's resource tracker
            int(c) for c in children
            if b"resource_tracker" not in open(f"/proc/{int(c)}/cmdline", "rb").read())
        os.kill(engine_pid, signal.SIGKILL)
        proc.wait(timeout=15)  # the front end notices and shuts down, no hang
        assert proc.returncode == 1  # not 0: it did not end the way an operator asked
        last = proc.stdout.read().strip().splitlines()[-1]
        assert "exits with code 1: the engine died: killed by SIGKILL" in last, last
    finally:
        if proc.poll() is None:
            stop_server(proc)


def test_many_streaming_clients_some_disconnecting(server):
    """150 concurrent streaming clients, every third hangs up early: every request completes
    or is aborted, nothing is lost, and the pool balances afterwards."""
    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server, timeout=120, limits=limits) as client:
            async def one(i):
                body = {"model": MODEL, "prompt": f"Return {i} of", "max_tokens": 12,
                        "temperature": 0, "stream": True}
                chunks = 0
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks += 1
                        if i % 3 == 0 and chunks == 2:
                            return "hung up"
                        if line == "data: [DONE]":
                            return "done"
                return "truncated"
            return await asyncio.gather(*(one(i) for i in range(150)))

    results = asyncio.run(main())
    assert results.count("done") == 100 and results.count("hung up") == 50
    info = idle_accounting(server, deadline_s=30)
    assert info["running"] == 0 and info["waiting"] == 0
    assert info["pool"]["balanced"] and info["pool"]["private"] == 0


def test_serve_help_renders_every_flag():
    """Every config docstring becomes argparse help: a bare "%" in one crashed --help."""
    import sys

    out = subprocess.run([sys.executable, "-m", "phaseflip.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--overlap-schedule" in out.stdout and "--enable-flip" in out.stdout


def test_a_control_call_that_times_out_leaves_no_entry(tmp_path):
    """A control call the engine does not answer in time (a long flip) raises and forgets its
    call id, instead of leaving it in the table for ever."""
    import asyncio

    import zmq

    from phaseflip.server.engine_client import EngineClient

    async def go() -> None:
        client = EngineClient(f"ipc://{tmp_path}/req", f"ipc://{tmp_path}/out", None)
        silent = zmq.Context().socket(zmq.PULL)  # an engine that never answers
        silent.connect(f"ipc://{tmp_path}/req")
        try:
            with pytest.raises(asyncio.TimeoutError):
                await client.control("info", timeout_s=0.05)
            assert client._calls == {}
        finally:
            silent.close(linger=0)
            await client.close()

    asyncio.run(go())


def test_text_offset_indexes_non_ascii_text(client):
    """Issue 23 item 2: a token inside a multi-byte character is spelt `bytes:\\x..`, and every
    offset indexes the returned text (lm-eval slices context and continuation by them)."""
    text = "Return the café — naïve résumé ✓ 日本語 text."
    got = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True,
                                    logprobs=1)
    c = got.choices[0]
    lp = c.logprobs
    assert c.text == text
    assert lp.text_offset[lp.tokens.index(" text")] == text.index(" text")
    assert all(0 <= o <= len(text) for o in lp.text_offset)
    assert lp.text_offset == sorted(lp.text_offset)
    assert any(t.startswith("bytes:\\x") for t in lp.tokens)
    for tok, off in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("bytes:"):
            assert text[off:off + len(tok)] == tok, (tok, off)


def test_end_of_text_token_agrees_with_text(client):
    """Issue 23 item 3: the end-of-text token that stops generation is not in `text`, so it is
    spelt "" in `tokens` (its logprob kept), and ''.join(tokens) == text; when the text keeps
    it, so do the tokens."""
    eos = 0  # <|endoftext|> of the embedded tokenizer
    got = client.completions.create(model=MODEL, prompt="Return the", max_tokens=5, echo=True,
                                    logprobs=1, logit_bias={str(eos): 100})
    c = got.choices[0]
    assert c.finish_reason == "stop" and c.text == "Return the"
    assert c.logprobs.tokens[-1] == "" and c.logprobs.text_offset[-1] == len(c.text)
    assert c.logprobs.token_logprobs[-1] is not None
    assert "".join(c.logprobs.tokens) == c.text
    kept = client.completions.create(model=MODEL, prompt="Return the", max_tokens=5, echo=True,
                                     logprobs=1, logit_bias={str(eos): 100},
                                     extra_body={"skip_special_tokens": False,
                                                 "include_stop_str_in_output": True}).choices[0]
    assert kept.text == "Return the<|endoftext|>" == "".join(kept.logprobs.tokens)


def test_stop_reason_is_null_on_eos_and_names_a_stop_string_or_token(server):
    """Issue 21 item 5: `stop_reason` as vLLM reports it: the stop string or stop_token_ids
    entry that ended the choice, null on the end-of-sequence token (it said 0, EOS's id)."""
    eos, tok = 0, 500  # <|endoftext|>; an ordinary token, forced by the bias below

    def choices(path: str, **body) -> list[dict]:
        body = {"model": MODEL, "max_tokens": 8, "temperature": 0} | body
        if path.endswith("chat/completions"):
            body["messages"] = [{"role": "user", "content": "Return the"}]
        else:
            body["prompt"] = "Return the"
        r = httpx.post(server + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not body.get("stream"):
            return r.json()["choices"]
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        return [c for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]

    def ends(path: str, **body) -> list[tuple]:
        return [(c["finish_reason"], c["stop_reason"]) for c in choices(path, **body)]

    for path in ("/v1/completions", "/v1/chat/completions"):
        for stream in (False, True):
            assert ends(path, stream=stream, logit_bias={str(eos): 100}) == [("stop", None)]
            assert ends(path, stream=stream, logit_bias={str(tok): 100},
                        stop_token_ids=[tok]) == [("stop", tok)]
            assert ends(path, stream=stream, max_tokens=2,
                        logit_bias={str(tok): 100}) == [("length", None)]
    text = choices("/v1/completions")[0]["text"]
    stop = text.strip()[-3:]
    assert len(stop) == 3, text
    for stream in (False, True):
        assert ends("/v1/completions", stream=stream, stop=[stop]) == [("stop", stop)]
