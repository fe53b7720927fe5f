"""Finishing, stop strings, n > 1, seeds, penalties and bad input through the whole engine."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from phaseflip import ContextLengthError, Engine, InvalidRequestError, SamplingParams
from tests.conftest import prompts_for

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def test_first_token_eos_after_chunked_prefill(llama_dir, tmp_path, make_engine):
    """Regression: the first sampled token is EOS right after the last prefill chunk."""
    probe = make_engine(llama_dir)
    prompt = prompts_for(probe.model_config.vocab_size)[3]  # 33 tokens
    first = probe.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids[0]
    model = tmp_path / "eos-model"
    shutil.copytree(llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    for chunk in (4, 11, 0):
        engine = make_engine(model, chunked_prefill_size=chunk)
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8),
                              use_tqdm=False)[0]
        assert out.token_ids == [first]
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].matched_stop == first
        assert out.text == ""
        assert out.usage.completion_tokens == 1


def test_stop_string_straddling_tokens(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    prompt = prompts_for(engine.model_config.vocab_size)[2]
    full = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    tok = engine.tokenizer
    pieces = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]
    # a stop string that starts inside token 2's text and ends inside token 4's
    a, b = len(pieces[2]) - 1, len(pieces[4]) - 1
    assert 0 <= a < b, pieces
    stop = full.text[a:b + 1]
    assert stop and stop not in full.text[:a + len(stop) - 1]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, stop=[stop],
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].matched_stop == stop
    assert out.text == full.text[:a]
    kept = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                    stop=[stop], include_stop_str_in_output=True,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert kept.text == full.text[:a] + stop


def test_stop_token_ids_and_min_tokens(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    prompt = prompts_for(engine.model_config.vocab_size)[1]
    full = engine.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    stop_at = full[2]
    k = full.index(stop_at)
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == full[: k + 1] and out.outputs[0].matched_stop == stop_at
    later = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8,
                                                     stop_token_ids=[stop_at],
                                                     min_new_tokens=k + 2), use_tqdm=False)[0]
    assert len(later.token_ids) >= k + 2
    assert stop_at not in later.token_ids[: k + 1]


def test_n_samples_share_prompt_kv(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    prompt = prompts_for(engine.model_config.vocab_size)[3]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=4, seed=7, ignore_eos=True)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(len(o.token_ids) == 6 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "samples should differ"
    stats = engine.core.scheduler.stats
    # the prompt is prefilled once; each other sample recomputes at most its last token
    assert stats.prefill_tokens <= len(prompt) + 3
    again = engine.generate([prompt], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert out.usage.completion_tokens == 24


def test_seed_reproducible_regardless_of_batch(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    prompts = prompts_for(engine.model_config.vocab_size)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=42,
                            ignore_eos=True)
    alone = engine.generate([prompts[2]], seeded, use_tqdm=False)[0].token_ids
    other = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    batch = engine.generate(prompts, [other, other, seeded] + [other] * (len(prompts) - 3),
                            use_tqdm=False)
    assert batch[2].token_ids == alone
    different = engine.generate([prompts[2]], SamplingParams(
        temperature=1.0, top_p=0.9, max_new_tokens=8, seed=43, ignore_eos=True),
        use_tqdm=False)[0].token_ids
    assert different != alone


def test_repetition_penalty_matches_transformers(model_dirs, make_engine):
    import torch
    from transformers import AutoModelForCausalLM

    d = model_dirs["llama"]
    engine = make_engine(d)
    prompt = prompts_for(engine.model_config.vocab_size)[2]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=10,
                                                   repetition_penalty=1.8, ignore_eos=True),
                          use_tqdm=False)[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=10, min_new_tokens=10, repetition_penalty=1.8,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert out == ref


def test_max_new_tokens_zero_scores_prompt(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    prompt = prompts_for(engine.model_config.vocab_size)[2]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=0, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert out.token_ids == [] and out.outputs[0].finish_reason == "length"
    assert out.prompt_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in out.prompt_logprobs[1:])


@pytest.mark.parametrize(
    "prompt, params, error, param",
    [
        ("", SamplingParams(), InvalidRequestError, "prompt"),
        ([], SamplingParams(), InvalidRequestError, "prompt"),
        ([1, 2, 10**9], SamplingParams(), InvalidRequestError, "prompt"),
        ([1, 2], SamplingParams(temperature=-1.0), InvalidRequestError, "temperature"),
        ([1, 2], SamplingParams(top_p=math.nan), InvalidRequestError, "top_p"),
        ([1, 2], SamplingParams(max_new_tokens=-3), InvalidRequestError, "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=10**6), ContextLengthError, "max_new_tokens"),
        ([1] * 600, SamplingParams(max_new_tokens=1), ContextLengthError, "max_new_tokens"),
    ],
)
def test_bad_input_is_refused_before_running(prompt, params, error, param, llama_dir,
                                             make_engine):
    engine = make_engine(llama_dir)
    with pytest.raises(error) as info:
        engine.generate([prompt, [1, 2, 3]], params, use_tqdm=False)
    assert info.value.param == param
    assert not engine.core.has_work()  # the valid prompt of the batch was not queued either
    assert str(info.value)


def test_context_error_names_the_numbers(llama_dir, make_engine):
    engine = make_engine(llama_dir)
    with pytest.raises(ContextLengthError, match=r"512 tokens.*600 were requested"):
        engine.generate([[1] * 500], SamplingParams(max_new_tokens=100), use_tqdm=False)


def test_pool_too_small_for_request(llama_dir, make_engine):
    engine = make_engine(llama_dir, max_total_tokens=32)
    with pytest.raises(ContextLengthError, match="pool holds only 32"):
        engine.generate([[1] * 30], SamplingParams(max_new_tokens=8), use_tqdm=False)


def test_unknown_option_and_bad_model_dir(tmp_path):
    from phaseflip import ModelLoadError

    with pytest.raises(InvalidRequestError, match="unknown engine options"):
        Engine(str(tmp_path), no_such_option=1)
    with pytest.raises(ModelLoadError):
        Engine(str(tmp_path / "missing"), device="cpu")


def test_max_running_requests_is_respected(llama_dir, make_engine):
    engine = make_engine(llama_dir, max_running_requests=2)
    sched = engine.core.scheduler
    schedule, peak = sched.schedule, []

    def spy():
        batch = schedule()
        peak.append(len(sched.running))
        return batch

    sched.schedule = spy
    prompts = prompts_for(engine.model_config.vocab_size)
    outs = engine.generate(prompts, GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == 8 for o in outs)
    assert max(peak) == 2
