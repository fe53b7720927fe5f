"""`--stream-interval N`: a stream's first token at once, then a delta every N tokens, and its
last at its end; what it carries is what N = 1 sends, in fewer deltas."""

from __future__ import annotations

import asyncio

import pytest

from phaseflip import SamplingParams


def _stream(engine, params: SamplingParams) -> list:
    async def main():
        return [d async for d in engine.generate_stream([5, 6, 7], params)]

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("stop", [None, ["never-generated-stop"]])
def test_deltas_come_every_n_tokens_with_the_same_text(llama_dir, make_engine, stop):
    """10 tokens at N = 4: 1 (the first, at once), 4, 4, 1 (the end); the text, tokens and
    logprobs concatenate to N = 1's (the stop-string path makes text at once: the same)."""
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, logprobs=1,
                            stop=stop)
    each = _stream(make_engine(llama_dir), params)
    every4 = _stream(make_engine(llama_dir, stream_interval=4), params)
    assert [len(d.token_ids) for d in each] == [1] * 10
    assert [len(d.token_ids) for d in every4] == [1, 4, 4, 1]
    for field in ("token_ids", "logprobs", "top_logprobs"):
        assert [x for d in every4 for x in getattr(d, field)] == \
            [x for d in each for x in getattr(d, field)]
    assert "".join(d.text for d in every4) == "".join(d.text for d in each)
    assert every4[-1].finish_reason == "length" and every4[-1].usage == each[-1].usage
    assert every4[0].cached_tokens is not None


def test_offline_generate_is_unchanged(llama_dir, make_engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=9, ignore_eos=True)
    want = make_engine(llama_dir).generate([[1, 2, 3], [4, 5]], params, use_tqdm=False)
    got = make_engine(llama_dir, stream_interval=3).generate([[1, 2, 3], [4, 5]], params,
                                                              use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]


def test_an_interval_below_one_is_refused():
    from phaseflip.config import EngineConfig

    with pytest.raises(ValueError, match="stream_interval"):
        EngineConfig(stream_interval=0)
