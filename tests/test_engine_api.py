"""Engine API edge cases: streams beside offline calls, shutdown, ids, resume, stops."""

from __future__ import annotations

import asyncio

import pytest

from phaseflip import SamplingParams
from tests.core_steps import run_in_order

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def test_generate_while_streaming(llama_dir, make_engine):
    """Offline generate() while a stream is in flight: generate steps the stream's request
    too and looks its deltas up in its own results dict."""
    engine = make_engine(llama_dir)
    long = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)

    async def main():
        agen = engine.generate_stream([5, 6, 7], long)
        first = await agen.__anext__()  # the stream's request is now running in the core
        assert first.token_ids
        loop = asyncio.get_running_loop()
        offline = await loop.run_in_executor(
            None, lambda: engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False))
        ids = list(first.token_ids)
        async for d in agen:
            ids += d.token_ids
        return offline, ids

    offline, ids = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(offline[0].token_ids) == 8
    assert len(ids) == 200


def test_duplicate_stream_request_id_does_not_hijack_first(llama_dir, make_engine):
    """A second stream reusing a live request_id must be refused without touching the first
    one; today it steals the first one's subscription and then aborts it, so the first hangs."""
    from phaseflip import InvalidRequestError

    engine = make_engine(llama_dir)
    long = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)

    async def main():
        a = engine.generate_stream([5, 6, 7], long, request_id="x")
        first = await a.__anext__()
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate_stream([1, 2], long, request_id="x"):
                pass
        ids, finish = list(first.token_ids), None
        async for d in a:
            ids += d.token_ids
            finish = d.finish_reason
        return ids, finish

    ids, finish = asyncio.run(asyncio.wait_for(main(), 30))
    assert finish == "length" and len(ids) == 40


def test_shutdown_ends_inflight_streams(llama_dir):
    """shutdown() with a stream in flight must end it (finish or error), not leave the
    consumer awaiting forever."""
    from phaseflip import Engine

    engine = Engine(str(llama_dir), device="cpu", dtype="float32", max_total_tokens=4096)
    long = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)

    async def main():
        agen = engine.generate_stream([5, 6, 7], long)
        await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        try:
            async for _ in agen:
                pass
        except Exception:
            pass  # an error is an acceptable way to end it

    asyncio.run(asyncio.wait_for(main(), 30))


def test_stop_string_completed_before_min_tokens(llama_dir, make_engine):
    """A stop string that was complete before min_new_tokens was reached must not end the
    request later (it is matched retroactively today, and the streamed text then holds half
    of it: neither the full text nor the text cut at the stop)."""
    from tests.conftest import prompts_for

    engine = make_engine(llama_dir)
    tok = engine.tokenizer
    for prompt in prompts_for(engine.model_config.vocab_size):
        full = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        first = tok.decode(full.token_ids[:1])
        # the stop appears once in the whole output: inside the first token, before
        # min_new_tokens, so the request must run to its length
        if len(first) >= 2 and "\ufffd" not in first and full.text.count(first[-2:]) == 1:
            break
    else:
        pytest.skip("no prompt whose first token decodes to >= 2 characters")
    stop = first[-2:]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                   ignore_eos=True, stop=[stop],
                                                   min_new_tokens=2), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length" and c.text == full.text, (c, full.text, stop)


def test_engine_thread_failure_reaches_streams(llama_dir, make_engine, monkeypatch):
    """If the engine thread dies (any exception in step), in-flight streams must get the error
    instead of waiting forever."""
    engine = make_engine(llama_dir)
    real_step = engine.core.step
    calls = []

    def failing_step(sink=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return real_step(sink=sink)

    monkeypatch.setattr(engine.core, "step", failing_step)

    async def main():
        with pytest.raises(RuntimeError, match="injected"):
            async for _ in engine.generate_stream([5, 6, 7], GREEDY):
                pass

    try:
        asyncio.run(asyncio.wait_for(main(), 20))
    finally:  # leave the engine clean for the fixture's teardown checks
        monkeypatch.undo()
        with engine._lock:
            for rid in list(engine.core.groups):
                engine.core.abort(rid)


def test_resumed_request_reuses_its_generated_kv(llama_dir, make_engine):
    """A retracted request's generated tokens are published to the tree on release, but the
    match limit on resume is min(num_tokens - 1, prompt_lp_next) = len(prompt) for requests
    without prompt logprobs, so everything it generated is recomputed."""
    engine = make_engine(llama_dir, max_total_tokens=29)
    a, b = list(range(3, 13)), list(range(100, 110))
    run_in_order(engine.core, [a, b], [  # a admitted first, so b is the one retracted
        SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_new_tokens=15, ignore_eos=True),
    ])
    stats = engine.core.scheduler.stats
    assert stats.retractions == 1
    assert stats.prefill_tokens == len(a) + len(b)  # b resumes from its own cached KV


def test_text_of_a_step_is_made_while_the_next_forward_runs(llama_dir, make_engine):
    """Overlap: step k+1's forward is queued before step k's tokens are detokenised, so the
    host's text work runs while the GPU computes. Requests with stop strings are the
    exception: their text is made at once, because a stop string ends the request."""
    engine = make_engine(llama_dir)
    core = engine.core
    events: list[tuple[str, int]] = []
    forward = core.runner.forward

    def spy_forward(plan):
        events.append(("forward", len(events)))
        return forward(plan)

    core.runner.forward = spy_forward
    params = {"plain": GREEDY,
              "stop": SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True,
                                     stop=["\x00never"])}
    for rid, p in params.items():
        core.add_request(rid, [5, 6, 7], p)
    for req in core.scheduler.waiting:
        append = req.detok.append

        def spy_append(ids, append=append, name=req.rid):
            events.append((name, len(events)))
            return append(ids)

        req.detok.append = spy_append
    finished = set()
    while core.has_work():
        finished |= {d.request_id for d in core.step() if d.finish_reason}
    assert finished == {"plain", "stop"}
    order = [name for name, _ in events]
    forwards = [i for i, n in enumerate(order) if n == "forward"]
    plain = [i for i, n in enumerate(order) if n == "plain#0"]
    stop = [i for i, n in enumerate(order) if n == "stop#0"]
    assert len(plain) == len(stop) == 8
    # token k of "plain" (sampled in forward k) is detokenised after forward k+1 was queued
    for k, at in enumerate(plain[:-1]):
        assert forwards[k + 1] < at < forwards[k + 2] if k + 2 < len(forwards) else True
    # "stop" text is made in the step that sampled it, before the next forward
    for k, at in enumerate(stop[:-1]):
        assert forwards[k] < at < forwards[k + 1]


def test_a_sink_gets_the_previous_steps_text_before_this_step_samples(llama_dir, make_engine):
    """Streaming loops pass a sink: step k-1's deltas leave before step k waits for the GPU
    to sample, so clients see each token one forward earlier than returning them would."""
    engine = make_engine(llama_dir)
    core = engine.core
    events: list[str] = []
    sample = core.sampling.sample

    def spy_sample(batch, logits):
        events.append("sample")
        return sample(batch, logits)

    core.sampling.sample = spy_sample
    core.add_request("r", [5, 6, 7], GREEDY)
    got: list[int] = []

    def sink(deltas):
        events.append("sink")
        got.extend(t for d in deltas for t in d.token_ids)

    while core.has_work():
        for d in core.step(sink=sink):
            got.extend(d.token_ids)
    assert len(got) == GREEDY.max_new_tokens
    samples = [i for i, e in enumerate(events) if e == "sample"]
    assert all(events[i - 1] == "sink" for i in samples[1:]), events


def test_streamed_text_holds_back_only_a_possible_stop_prefix(llama_dir, make_engine):
    """With stop strings, a delta holds back only the suffix that may still become one
    (`partial_stop_len`), not the longest stop's length on every step: here nothing."""
    core = make_engine(llama_dir).core
    stop = "\x01\x02\x03\x04\x05\x06\x07\x08"  # never in the tiny model's text
    core.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_new_tokens=6,
                                                    ignore_eos=True, stop=[stop]))
    req = core.groups["r"].reqs[0]
    streamed = ""
    while not req.finished:
        streamed += "".join(d.text for d in core.step())
        if not req.finished:
            assert streamed == req.detok.text, (streamed, req.detok.text)
    assert len(req.detok.text) >= len(stop)  # the old rule would have held text back
