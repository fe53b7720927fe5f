"""Greedy outputs and logprobs equal the `transformers` reference, under every cache setting."""

from __future__ import annotations

import pytest
import torch

from phaseflip import SamplingParams
from tests.conftest import ARCHS, hf_greedy, hf_logprobs, prompts_for

MAX_NEW = 10


@pytest.fixture(scope="session")
def references(model_dirs):
    cache = {}

    def ref(arch: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (arch, tuple(map(tuple, prompts)))
        if key not in cache:
            cache[key] = hf_greedy(model_dirs[arch], prompts, MAX_NEW)
        return cache[key]

    return ref


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(arch, model_dirs, references, make_engine):
    engine = make_engine(model_dirs[arch])
    prompts = prompts_for(engine.model_config.vocab_size)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == references(arch, prompts)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_transformers(arch, model_dirs, make_engine):
    engine = make_engine(model_dirs[arch], chunked_prefill_size=7)
    prompt = prompts_for(engine.model_config.vocab_size)[2]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    ids = prompt + out.token_ids
    ref = hf_logprobs(model_dirs[arch], ids)
    assert out.prompt_logprobs[0] is None
    want_prompt = [ref[p - 1, ids[p]].item() for p in range(1, len(prompt))]
    assert out.prompt_logprobs[1:] == pytest.approx(want_prompt, abs=1e-4)
    want_out = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.outputs[0].logprobs == pytest.approx(want_out, abs=1e-4)
    for i, top in enumerate(out.outputs[0].top_logprobs):
        vals, idx = ref[len(prompt) - 1 + i].topk(3)
        assert [t for t, _ in top] == idx.tolist()
        assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-4)
    top_p = out.prompt_top_logprobs[5]
    assert [t for t, _ in top_p] == ref[4].topk(2).indices.tolist()


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 64, 0])
@pytest.mark.parametrize("page_size", [1, 16])
def test_same_outputs_for_every_cache_setting(prefix_cache, chunk, page_size, llama_dir,
                                              references, make_engine):
    engine = make_engine(llama_dir, enable_prefix_cache=prefix_cache, chunked_prefill_size=chunk,
                         page_size=page_size)
    prompts = prompts_for(engine.model_config.vocab_size)
    first = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == references("llama", prompts)
    again = engine.generate(prompts[::-1], GREEDY, use_tqdm=False)  # now with cache hits
    assert [o.token_ids for o in again] == references("llama", prompts)[::-1]
    if prefix_cache:
        assert sum(o.usage.cached_tokens for o in again) > 0
    else:
        assert all(o.usage.cached_tokens == 0 for o in again)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_keeps_greedy_output(page_size, llama_dir, references, make_engine):
    engine = make_engine(llama_dir, max_total_tokens=96, page_size=page_size,
                         chunked_prefill_size=16)
    prompts = prompts_for(engine.model_config.vocab_size, shared=False) * 2
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True)
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.core.scheduler.stats.retractions > 0, "budget too large to force retraction"
    assert [o.token_ids for o in outs] == references("llama", prompts[:4]) * 2


def test_schedule_policies_agree(llama_dir, references, make_engine):
    engine = make_engine(llama_dir, schedule_policy="lpm", max_running_requests=2)
    prompts = prompts_for(engine.model_config.vocab_size)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == references("llama", prompts)


def test_streaming_equals_offline(llama_dir, make_engine):
    import asyncio

    engine = make_engine(llama_dir)
    prompts = prompts_for(engine.model_config.vocab_size)[:3]
    offline = engine.generate(prompts, GREEDY, use_tqdm=False)

    async def collect(p):
        ids, text, finish = [], "", None
        async for d in engine.generate_stream(p, GREEDY):
            ids += d.token_ids
            text += d.text
            finish = d.finish_reason or finish
        return ids, text, finish

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    streamed = asyncio.run(main())
    for off, (ids, text, finish) in zip(offline, streamed):
        assert ids == off.token_ids and text == off.text and finish == "length"


def test_bf16_runs_and_mostly_agrees(llama_dir, make_engine):
    engine = make_engine(llama_dir, dtype="bfloat16")
    out = engine.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == MAX_NEW
    assert engine.core.runner.pool.k[0].dtype == torch.bfloat16
