from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import (
    Sampler,
    SamplingInput,
    apply_penalties,
    compute_logprobs,
    filter_logits,
    greedy,
    step_seed,
)

VOCAB = 50


def _row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    out: list[int] | None = None,
    eos: tuple[int, ...] = (),
) -> SamplingInput:
    return SamplingInput(
        params=params, prompt_ids=prompt or [], output_ids=out or [], eos_token_ids=eos
    )


def _kept(filtered: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(r)).flatten().tolist()) for r in filtered]


# ---------------------------------------------------------------- params


def test_params_normalise_and_properties() -> None:
    p = SamplingParams(stop="###")
    assert p.stop == ["###"]
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(top_k=1, temperature=0.7).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy
    q = replace(p, temperature=0.0)
    assert q.is_greedy and q.stop == ["###"] and not p.is_greedy
    # Defaults must not be shared between instances.
    a, b = SamplingParams(), SamplingParams()
    assert a.stop is not b.stop and a.stop_token_ids is not b.stop_token_ids


def test_validate_accepts_edge_values() -> None:
    SamplingParams(max_new_tokens=0).validate(VOCAB)
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=VOCAB * 3,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        logit_bias={0: -100.0, VOCAB - 1: 100},
        n=128,
        seed=-5,
        stop=["x"],
        stop_token_ids=[VOCAB - 1],
        logprobs=20,
        prompt_logprobs=0,
    ).validate(VOCAB, max_logprobs=20)


NAN = float("nan")
INF = float("inf")

BAD: list[tuple[dict[str, Any], str]] = [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": "16"}, "max_new_tokens"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": NAN}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": NAN}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"presence_penalty": -3.0}, "presence_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: NAN}}, "logit_bias"),
    ({"logit_bias": {1: 100.5}}, "logit_bias"),
    ({"logit_bias": {1: -101.0}}, "logit_bias"),
    ({"top_k": 2**31}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": 5}, "stop"),  # the Python API's dicts: no schema ahead of it
    ({"stop": {"a"}}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD, ids=[f"{p}-{k}" for k, p in BAD])
def test_validate_rejects(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs).validate(VOCAB, max_logprobs=20)
    assert info.value.param == param
    assert param in str(info.value)


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_both_signs() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5])
    apply_penalties(
        logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0, 0], output_ids=[1]
    )
    torch.testing.assert_close(logits, torch.tensor([1.0, -2.0, 0.5, 3.0, -0.5]))


def test_frequency_presence_over_output_only() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    apply_penalties(logits, params, prompt_ids=[3, 3], output_ids=[2, 2, 1])
    torch.testing.assert_close(logits, torch.tensor([1.0, 0.25, -0.25, 1.0]))


def test_logit_bias_then_repetition_penalty() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0])
    params = SamplingParams(logit_bias={0: 1.0, 2: -1.5}, repetition_penalty=2.0)
    apply_penalties(logits, params, prompt_ids=[0], output_ids=[])
    # bias first: 1+1 = 2, then penalty: 2/2 = 1 (the reverse order would give 1.5)
    torch.testing.assert_close(logits, torch.tensor([1.0, 0.0, -2.5]))


def test_sampler_applies_penalties_before_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, 0.0], [3.0, 2.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    out = Sampler().sample(
        logits,
        [
            _row(replace(greedy, repetition_penalty=2.0), prompt=[0]),
            _row(greedy, prompt=[0]),
            _row(replace(greedy, logit_bias={3: 1.5})),
        ],
    )
    assert out.token_ids == [1, 0, 3]
    assert out.logprobs is None and out.top_logprobs is None


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, 6)
    logits[0, 5] = 10.0  # eos
    logits[0, 4] = 9.0  # stop token id
    logits[0, 2] = 1.0
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[4], ignore_eos=True)
    before = sampler.sample(logits, [_row(params, out=[0], eos=(5,))])
    assert before.token_ids == [2]
    after = sampler.sample(logits, [_row(params, out=[0, 2], eos=(5,))])
    assert after.token_ids == [5]
    # Random rows are masked too: eos carries nearly all the mass but is never drawn.
    rnd = replace(params, temperature=1.0)
    many = sampler.sample(logits.expand(64, 6), [_row(rnd, out=[], eos=(5,)) for _ in range(64)])
    assert 5 not in many.token_ids and 4 not in many.token_ids


# ---------------------------------------------------------------- filters


PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "expected"),
    [
        (2, 1.0, 0.0, {0, 1}),
        (-1, 1.0, 0.0, {0, 1, 2, 3, 4}),
        (0, 1.0, 0.0, {0, 1, 2, 3, 4}),
        (99, 1.0, 0.0, {0, 1, 2, 3, 4}),
        (-1, 0.69, 0.0, {0, 1}),
        (-1, 0.71, 0.0, {0, 1, 2}),
        (-1, 0.01, 0.0, {0}),
        (-1, 0.8, 0.0, {0, 1, 2}),
        (3, 0.8, 0.0, {0, 1}),  # top-p sees the renormalised top-3 distribution
        (-1, 1.0, 0.35, {0, 1}),
        (-1, 1.0, 0.29, {0, 1, 2}),
        (-1, 1.0, 1.0, {0}),
        (4, 0.9, 0.25, {0, 1, 2}),
    ],
)
def test_filter_logits_keeps_expected_set(
    top_k: int, top_p: float, min_p: float, expected: set[int]
) -> None:
    perm = torch.tensor([3, 0, 4, 1, 2])  # shuffle so positions differ from ranks
    logits = PROBS.log()[perm].unsqueeze(0)
    kept = _kept(filter_logits(logits, top_k=top_k, top_p=top_p, min_p=min_p))[0]
    assert {int(perm[i]) for i in kept} == expected


def test_filter_logits_per_row_params() -> None:
    logits = PROBS.log().expand(3, 5)
    out = filter_logits(logits, top_k=[2, -1, -1], top_p=[1.0, 0.69, 1.0], min_p=[0.0, 0.0, 0.35])
    assert _kept(out) == [{0, 1}, {0, 1}, {0, 1}]
    assert _kept(filter_logits(logits, top_k=[1, 3, 5]))[:2] == [{0}, {0, 1, 2}]
    torch.testing.assert_close(out[0, :2], logits[0, :2])  # kept values untouched


def test_sampling_stays_in_filtered_set_and_matches_distribution() -> None:
    logits = PROBS.log().unsqueeze(0).expand(4000, 5).contiguous()
    sampler = Sampler(seed=1)
    out = sampler.sample(logits, [_row(SamplingParams(top_k=3)) for _ in range(4000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float() / 4000
    expected = torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85
    assert torch.allclose(counts, expected, atol=0.03), counts
    hot = sampler.sample(logits, [_row(SamplingParams(temperature=2.0)) for _ in range(4000)])
    hot_counts = torch.bincount(torch.tensor(hot.token_ids), minlength=5).float() / 4000
    hot_expected = torch.softmax(PROBS.log() / 2.0, dim=0)
    assert torch.allclose(hot_counts, hot_expected, atol=0.03), hot_counts


def test_greedy_argmax_ties_to_lowest_id_and_tiny_temperature() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [2.0, 1.0, 2.0, 0.0], [0.0, 1.0, 3.0, 2.9]])
    out = Sampler().sample(
        logits,
        [
            _row(SamplingParams(temperature=0.0)),
            _row(SamplingParams(top_k=1)),
            _row(SamplingParams(temperature=1e-30)),
        ],
    )
    assert out.token_ids == [1, 0, 2]


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    rows = [
        _row(SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.7), prompt=[1, 2]),
        _row(SamplingParams(temperature=0.0)),  # asked for nothing
        _row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={7: 50.0})),
        _row(SamplingParams(top_p=0.5, logprobs=5, seed=3)),
    ]
    out = Sampler().sample(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    assert out.token_ids[2] == 7  # the bias steered the choice ...
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, tok in enumerate(out.token_ids):  # ... but logprobs come from the raw logits
        assert math.isclose(out.logprobs[i], ref[i, tok].item(), abs_tol=1e-6)
    assert [len(t) for t in out.top_logprobs] == [3, 0, 0, 5]
    for i, top in enumerate(out.top_logprobs):
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        ref_vals, ref_ids = ref[i].topk(len(top))
        assert [t for t, _ in top] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(values), ref_vals, atol=1e-6, rtol=0)


def test_compute_logprobs_helper() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]])
    chosen, vals, ids = compute_logprobs(logits, torch.tensor([0, 2]), top_k=2)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chosen, torch.stack([ref[0, 0], ref[1, 2]]))
    assert ids.tolist() == [[2, 1], [2, 0]]
    torch.testing.assert_close(vals, ref.gather(1, ids))
    _, empty_vals, empty_ids = compute_logprobs(logits, torch.tensor([0, 2]), top_k=0)
    assert empty_vals.shape == (2, 0) and empty_ids.shape == (2, 0)


# ---------------------------------------------------------------- seeds


def _fake_model_logits(step: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, VOCAB, generator=gen)


def _generate(
    seed: int, position: int, batch: int, steps: int = 12, sampler_seed: int = 0
) -> list[int]:
    """Generate `steps` tokens for a seeded row at `position` among unseeded/greedy neighbours."""
    sampler = Sampler(seed=sampler_seed)
    out: list[int] = []
    target = SamplingParams(temperature=1.0, seed=seed)
    for step in range(steps):
        row_logits = _fake_model_logits(step, 1)
        logits = torch.randn(batch, VOCAB) * 5
        logits[position] = row_logits[0]
        inputs = []
        for i in range(batch):
            if i == position:
                inputs.append(_row(target, out=list(out)))
            elif i % 2:
                inputs.append(_row(SamplingParams(temperature=0.8, top_p=0.9), out=[1] * i))
            else:
                inputs.append(_row(SamplingParams(temperature=0.0)))
        out.append(Sampler.sample(sampler, logits, inputs).token_ids[position])
    return out


def test_seed_reproducible_regardless_of_batch() -> None:
    alone = _generate(seed=42, position=0, batch=1)
    in_batch = _generate(seed=42, position=3, batch=6, sampler_seed=7)
    assert alone == in_batch
    assert len(set(alone)) > 1  # really sampled, not argmax-like
    assert _generate(seed=43, position=0, batch=1) != alone


def test_seeded_draw_depends_on_step_not_history() -> None:
    # After preemption the engine recomputes: a fresh sampler at the same step draws the same.
    logits = _fake_model_logits(5, 1).expand(2, VOCAB)
    params = SamplingParams(seed=9)
    a = Sampler(seed=1).sample(logits, [_row(params, out=[3] * 5), _row(params, out=[7] * 5)])
    b = Sampler(seed=2).sample(logits, [_row(params, out=[1] * 5), _row(params, out=[1] * 6)])
    assert a.token_ids[0] == a.token_ids[1] == b.token_ids[0]
    assert step_seed(9, 5) != step_seed(9, 6) and step_seed(9, 5) != step_seed(10, 5)
    # Same seed, same logits, successive steps: the draws must differ from step to step.
    flat = torch.zeros(1, VOCAB)
    per_step = [Sampler().sample(flat, [_row(params, out=[0] * s)]).token_ids[0] for s in range(8)]
    assert len(set(per_step)) > 1


def test_unseeded_rows_follow_sampler_seed() -> None:
    logits = torch.zeros(16, VOCAB)
    rows = [_row(SamplingParams()) for _ in range(16)]
    first = Sampler(seed=5).sample(logits, rows).token_ids
    assert Sampler(seed=5).sample(logits, rows).token_ids == first
    assert Sampler(seed=6).sample(logits, rows).token_ids != first


def test_shape_mismatch_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="does not match"):
        Sampler().sample(torch.zeros(2, 4), [_row(SamplingParams())])
    assert Sampler().sample(torch.zeros(0, 4), []).token_ids == []


def test_greedy_resolves_ties_to_the_lowest_id() -> None:
    """Greedy's contract, whichever reduction runs (max on the CPU, argmax elsewhere): the
    first maximal index, so ties resolve to the lowest id, as transformers' argmax does."""
    logits = torch.full((3, 131072), -1.0)
    logits[0, [7, 70_000, 131_071]] = 2.0
    logits[1, [65_536, 65_537]] = 5.0
    logits[2, :] = 0.0
    assert greedy(logits).tolist() == [7, 65_536, 0]
    assert torch.equal(greedy(logits), logits.argmax(dim=-1))
