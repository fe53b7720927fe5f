"""Sampling on the last pipeline stage (issue 16): with PP, rank 0 says which rows to sample
and how (`StepMessage.sample`), the last stage's TP rank 0 samples them and only the ids
cross to rank 0. The oracle is the driver's own `Sampler` (unit tests) and one process
(spawned ranks, under deadlines): the same tokens, ties included, for greedy and seeded rows;
a step with a row that needs the logits (logprobs, unseeded random, ...) ships them whole.
"""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from phaseflip import Engine, SamplingParams
from phaseflip.distributed.driver import DRIVER_SAMPLES_ENV
from phaseflip.distributed.group import NO_STAGE_PIPES_ENV
from phaseflip.distributed.plan_codec import PlanFrameError, StepMessage, decode_frame
from phaseflip.engine.sampling_step import SamplingStep, _inputs, logit_rows
from phaseflip.sampling.last_stage import (
    SampledTokens,
    SpecBuilder,
    pack,
    sample_parts,
    spec_for,
)
from phaseflip.sampling.sampler import Sampler
from tests.conftest import build_model, pp2_losing_a_micro_batch, prompts_for
from tests.test_plan_codec import _decode_step, _frame_bytes

SPAWNS = pytest.mark.timeout(300, method="thread")  # signals cannot interrupt gloo


class _Item(SimpleNamespace):
    """A scheduled item: a dict key by identity, as `Scheduled` is."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


def _batch(params: list[SamplingParams], outputs: int = 3, gap: int = 0, **req):
    """Sampling items, one logits row each (`gap` rows skipped before every other one)."""
    items, row = [], 0
    for i, p in enumerate(params):
        row += gap * (i % 2)
        r = SimpleNamespace(params=p, prompt_ids=[1, 2], output_ids=list(range(outputs)),
                            eos_ids=(0,), wants_prompt_logprobs=False, sampling_input=None)
        for k, v in req.items():
            setattr(r, k, v)
        items.append(_Item(req=r, samples=True, logit_row=row, num_logit_rows=1))
        row += 1
    return SimpleNamespace(items=items), row


def _mixed_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=7),
            SamplingParams(temperature=1.0, top_k=1),  # greedy by top_k
            SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=2**64 - 3),
            SamplingParams(temperature=0.5, min_p=0.2, seed=-5),
            SamplingParams(temperature=0)] * 3


@pytest.mark.parametrize("gap, cuts", [(0, [1]), (0, [2, 5]), (2, [3])])
def test_the_last_stage_samples_what_the_driver_would(gap, cuts):
    """Same ids as the driver's `Sampler` over the same logits: greedy rows (many ties: the
    first maximal index), seeded rows with temperature/top-k/top-p/min-p, rows cut into
    micro-batches, rows that are not consecutive."""
    params = _mixed_params()
    batch, rows = _batch(params, gap=gap)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (rows, 50), generator=gen).float()  # ties everywhere
    items = batch.items
    want = Sampler(0).sample(logit_rows(items, logits), _inputs(items)).token_ids
    spec = spec_for(batch, ahead=False)
    assert spec is not None and len(spec.ints) == 9
    parts = list(torch.tensor_split(logits, cuts))
    assert sample_parts(parts, spec).tolist() == want
    batch, _ = _batch([SamplingParams(temperature=0)] * 7, gap=gap)  # part by part
    greedy = spec_for(batch, ahead=True)
    assert greedy.ints is None
    want = Sampler(0).sample(logit_rows(batch.items, logits), _inputs(batch.items)).token_ids
    assert sample_parts(parts, greedy).tolist() == want


@pytest.mark.parametrize("params, req, ahead", [
    (SamplingParams(temperature=0, logprobs=2), {}, False),
    (SamplingParams(temperature=0.7), {}, False),  # unseeded: the driver's stream
    (SamplingParams(temperature=0.7, seed=3), {}, True),  # run ahead: output length lags
    (SamplingParams(temperature=0, repetition_penalty=1.2), {}, False),
    (SamplingParams(temperature=0, logit_bias={3: 1.0}), {}, False),
    (SamplingParams(temperature=0, min_new_tokens=5, stop_token_ids=[4]), {}, False),
    (SamplingParams(temperature=0, prompt_logprobs=1), {"wants_prompt_logprobs": True},
     False),
])
def test_a_row_that_needs_the_logits_is_the_drivers(params, req, ahead):
    """Its logits row ships (a mixed step); a step with no row for the last stage ships its
    logits whole (no spec)."""
    greedy = SamplingParams(temperature=0)
    spec = spec_for(_batch([greedy, params, greedy], **req)[0], ahead)
    assert spec.rows.tolist() == [0, 2] and spec.ship.tolist() == [1] and spec.local == [1]
    assert spec_for(_batch([params], **req)[0], ahead) is None
    assert spec_for(_batch([greedy] * 2)[0], ahead).ship is None


def _through_the_wire(logits: torch.Tensor, spec, cuts: list[int]) -> SampledTokens:
    """What rank 0 gets: the last stage's message from its micro-batches, unpacked."""
    parts, nbytes = pack(list(torch.tensor_split(logits, cuts)), spec)
    message = torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])
    shape, dtype = spec.message(logits.shape[1])
    assert message.numel() * message.element_size() == shape[0] * dtype.itemsize
    assert nbytes == 4 * logits.shape[1] * (0 if spec.ship is None else len(spec.ship))
    return SampledTokens.unpack(message.view(dtype), spec, logits.shape[1], copy=True)


@pytest.mark.parametrize("ahead", [False, True])
def test_a_mixed_step_samples_as_one_process(ahead):
    """Ids for the last stage's rows, logits for the driver's (logprobs, unseeded random,
    penalties; seeded rows too when run ahead): the same tokens, logprobs and generator
    stream as the driver sampling every row."""
    driver_rows = ([SamplingParams(temperature=0.9), SamplingParams(temperature=1.0, top_k=7)]
                   if ahead else [SamplingParams(temperature=0, logprobs=3),
                                  SamplingParams(temperature=0.9),
                                  SamplingParams(temperature=0, repetition_penalty=1.3)])
    params = (_mixed_params() + driver_rows) * 2
    batch, rows = _batch(params)
    logits = torch.randint(0, 4, (rows, 50), generator=torch.Generator().manual_seed(1)).float()
    spec = SpecBuilder().spec(batch, ahead)
    assert spec.local and spec.ship is not None
    got = _through_the_wire(logits, spec, [5])
    if ahead:
        want = SamplingStep(Sampler(0)).sample_ahead(batch, logits).tokens
        assert torch.equal(SamplingStep(Sampler(0)).sample_ahead(batch, lambda: got).tokens,
                           want)
    else:
        want = SamplingStep(Sampler(0)).sample(batch, logits)
        out = SamplingStep(Sampler(0)).sample(batch, got)
        # logprobs are kept only for rows that ask (`OutputProcessor.append_token`)
        asked = {it for it in batch.items if it.req.params.logprobs is not None}
        assert {it: v if it in asked else v[0] for it, v in out.items()} == {
            it: v if it in asked else v[0] for it, v in want.items()}


class _Grammars:
    """A grammar book whose constrained rows (params with a grammar) allow tokens 3 and 9."""

    def masks(self, reqs):
        rows = [i for i, r in enumerate(reqs) if r.params.grammar is not None]
        if not rows:
            return None
        bitmask = torch.zeros((len(rows), 2), dtype=torch.int32)  # 50 tokens: 2 words
        bitmask[:, 0] = (1 << 3) | (1 << 9)
        return rows, bitmask


@pytest.mark.parametrize("ahead", [False, True])
def test_a_mixed_step_with_grammar_rows_masks_them_on_the_driver(ahead):
    """Constrained rows are the driver's; their masks follow them into the driver's part of
    a mixed step (`_local_mask`), and the step equals one process's."""
    pytest.importorskip("xgrammar")  # the masks are applied by xgrammar (an optional extra)
    free, bound = SamplingParams(temperature=0), SamplingParams(temperature=0)
    bound = dataclasses.replace(bound, grammar=object())  # `SpecBuilder` reads only `is None`
    batch, rows = _batch([free, bound, free, free, bound, free])
    logits = torch.randn(rows, 50, generator=torch.Generator().manual_seed(2))
    spec = SpecBuilder().spec(batch, ahead)
    assert spec.local == [1, 4]
    got = _through_the_wire(logits, spec, [2])
    if ahead:
        out = SamplingStep(Sampler(0), _Grammars()).sample_ahead(batch, lambda: got).tokens
        want = SamplingStep(Sampler(0), _Grammars()).sample_ahead(batch, logits).tokens
        assert torch.equal(out, want)
    else:
        out = SamplingStep(Sampler(0), _Grammars()).sample(batch, got)
        want = SamplingStep(Sampler(0), _Grammars()).sample(batch, logits)
        assert out == want
    tokens = [int(t) for t in out] if ahead else [out[it][0] for it in batch.items]
    assert tokens[1] in (3, 9) and tokens[4] in (3, 9)


def test_the_builder_remembers_verdicts_per_params_object():
    """The engine's builder keeps each params object's verdict: a new object (even at a
    reused id) is judged anew, and the memory is bounded."""
    builder = SpecBuilder()
    builder.LIMIT = 2
    greedy = _batch([SamplingParams(temperature=0)] * 3)[0]
    assert builder.spec(greedy, ahead=True).rows.tolist() == [0, 1, 2]
    for _ in range(3):  # fresh objects, freed after each spec: ids come back
        assert builder.spec(_batch([SamplingParams(temperature=0, logprobs=1)])[0],
                            ahead=False) is None
        assert builder.spec(_batch([SamplingParams(temperature=0)])[0], ahead=True) is not None
    assert len(builder._kinds) <= 2


def test_the_spec_survives_the_frame_and_the_pickle():
    spec = spec_for(_batch(_mixed_params()[:5], gap=1)[0], ahead=False)  # rows 0..6 of 8
    msg = _decode_step(False)
    msg = StepMessage(msg.step, msg.plan, None, msg.fence, msg.future_len, None, msg.whole,
                      spec)
    for got in (decode_frame(_frame_bytes(msg)).sample, pickle.loads(pickle.dumps(msg)).sample):
        assert np.array_equal(got.rows, spec.rows) and np.array_equal(got.ints, spec.ints)
        assert got.floats.dtype == np.float64 and np.array_equal(got.floats, spec.floats)
        assert got.ship is None
    mixed = spec_for(_batch([SamplingParams(temperature=0),
                             SamplingParams(temperature=0, logprobs=1)])[0], ahead=False)
    msg.sample = mixed
    got = decode_frame(_frame_bytes(msg)).sample
    assert got.ship.tolist() == [1] and got.rows.tolist() == [0] and got.ints is None
    assert got.local is None and mixed.local == [1]  # rank 0's alone: not on the wire
    greedy = StepMessage(msg.step, msg.plan, sample=spec_for(_batch(
        [SamplingParams(temperature=0)] * 3)[0], ahead=True))
    got = decode_frame(_frame_bytes(greedy)).sample
    assert got.ints is None and got.rows.tolist() == [0, 1, 2]
    assert decode_frame(_frame_bytes(_decode_step(False))).sample is None


@pytest.mark.parametrize("bad", ["row", "ship", "item"])
def test_a_spec_that_names_rows_the_plan_lacks_is_a_frame_error(bad: str):
    """A row past the plan's logits would make the last stage send fewer ids than rank 0
    waits for (a hang on NCCL) or index out of bounds on the device: refused at decode."""
    msg = _decode_step(False)
    n = len(msg.plan.logits_indices)
    spec = spec_for(_batch([SamplingParams(temperature=0.7, seed=3)] * 2)[0], ahead=False)
    if bad == "row":
        spec.rows = np.array([0, n], dtype=np.int64)
    elif bad == "ship":
        spec.ship = np.array([n], dtype=np.int64)
    else:
        spec.ints = spec.ints.copy()
        spec.ints[1, 0] = 2
    msg = StepMessage(msg.step, msg.plan, sample=spec)
    with pytest.raises(PlanFrameError, match="lengths disagree"):
        decode_frame(_frame_bytes(msg))


# ------------------------------------------------------------------ spawned ranks
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """4 KV heads for tp=2."""
    return build_model(tmp_path_factory.mktemp("lss") / "llama4", "llama",
                       num_hidden_layers=4, num_key_value_heads=4)


def _workloads():
    """Greedy only (run ahead); greedy + seeded random + n > 1 (synchronous steps, the last
    stage samples the seeded rows); the same with a logprobs, an unseeded random and a
    prompt-logprobs request (mixed steps: their rows' logits ship); greedy + unseeded random
    (mixed steps run ahead)."""
    prompts = prompts_for(300)[:6]
    greedy = [SamplingParams(temperature=0, max_new_tokens=6 + i) for i in range(6)]
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, n=1 + (i % 2),
                             max_new_tokens=5) if i % 2 else greedy[i] for i in range(6)]
    driver = {0: SamplingParams(temperature=0, logprobs=2, max_new_tokens=4),
              2: SamplingParams(temperature=0.8, max_new_tokens=5),
              4: SamplingParams(temperature=0, prompt_logprobs=2, max_new_tokens=3)}
    mixed = [driver.get(i, seeded[i]) for i in range(6)]
    ahead = [SamplingParams(temperature=0.8, max_new_tokens=6) if i % 3 == 1 else greedy[i]
             for i in range(6)]
    return [(prompts, greedy), (prompts, seeded), (prompts, mixed), (prompts, ahead)]


def _driver_rows_at_most(prompts: list[list[int]]) -> int:
    """The most logits rows a mixed workload ships: the driver's requests' (a whole-step
    fallback ships every row of those steps)."""
    return 4 + 5 + len(prompts[4]) + 3


def _run(model_dir, **cfg):
    """Per workload: the outputs and what crossed to rank 0 (None: one process)."""
    cfg = {"device": "cpu", "dtype": "float32", "max_total_tokens": 2048,
           "dist_timeout_s": 60, "check_accounting": True} | cfg
    out = []
    with Engine(str(model_dir), **cfg) as e:
        stage = getattr(e.core.runner, "stage", None)
        for prompts, params in _workloads():
            before = dict(stage.shipped) if stage is not None else None
            outs = e.generate(prompts, params, use_tqdm=False)
            got = [[(s.token_ids, s.finish_reason, s.logprobs, o.prompt_logprobs)
                    for s in o.outputs] for o in outs]
            shipped = None if stage is None else {
                k: stage.shipped[k] - before[k] for k in before}
            if shipped is not None:
                shipped["logits_rows"] = shipped["logits_bytes"] // (
                    4 * e.core.model_cfg.vocab_size)
            out.append((got, shipped))
    return out


def _assert_same(runs: list, want: list) -> None:
    """Tokens and finishes exactly; logprobs to float32 rounding (a PP layout's logits may
    differ from one process's in the last bits, with or without this feature)."""
    assert len(runs) == len(want)
    for got, exp in zip(runs, want):
        assert [[s[:2] for s in o] for o in got] == [[s[:2] for s in o] for o in exp]
        for o, e in zip(got, exp):
            for s, t in zip(o, e):
                for a, b in zip(s[2:], t[2:]):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert [x is None for x in a] == [x is None for x in b]
                        assert [x for x in a if x is not None] == pytest.approx(
                            [x for x in b if x is not None], rel=1e-4, abs=1e-5)


@pytest.fixture(scope="module")
def oracle(model_dir):
    return [got for got, _ in _run(model_dir)]


@SPAWNS
@pytest.mark.parametrize("tp, pp, pipes, cfg", [
    (1, 2, True, {}), (1, 2, False, {}), (2, 2, True, {}), (1, 3, True, {}),
    (1, 2, True, {"pp_async_decode": True}),  # decode groups in flight
    (2, 2, False, {"pp_async_decode": True, "max_running_requests": 6}),
])
def test_ids_not_logits_cross_and_tokens_equal_one_process(model_dir, oracle, monkeypatch,
                                                           tp, pp, pipes, cfg):
    if not pipes:
        monkeypatch.setenv(NO_STAGE_PIPES_ENV, "1")
    runs = _run(model_dir, tp_size=tp, pp_size=pp, **cfg)
    # decode groups in flight batch the unseeded rows of the last workload otherwise than
    # one process does (the driver's stream then draws for other batches)
    same = 3 if cfg.get("pp_async_decode") else 4
    _assert_same([got for got, _ in runs][:same], oracle[:same])
    (_, greedy), (_, seeded), (_, mixed), (_, ahead) = runs
    assert greedy["logits_bytes"] == 0 and greedy["token_ids"] > 0  # red without the feature
    assert seeded["logits_bytes"] == 0 and seeded["token_ids"] > 0
    # mixed steps: ids, and logits for the driver's rows only (red with a whole-step fallback)
    assert 0 < mixed["logits_rows"] <= _driver_rows_at_most(_workloads()[2][0])
    assert mixed["token_ids"] > 0 and ahead["token_ids"] > 0 and ahead["logits_rows"] > 0


@SPAWNS
def test_the_driver_samples_when_told(model_dir, oracle, monkeypatch):
    """`PHASEFLIP_PP_DRIVER_SAMPLES`: the logits path, for comparison (benchmarks)."""
    monkeypatch.setenv(DRIVER_SAMPLES_ENV, "1")
    runs = _run(model_dir, pp_size=2)
    _assert_same([got for got, _ in runs], oracle)
    assert all(s["token_ids"] == 0 and s["logits_bytes"] > 0 for _, s in runs)


@pytest.mark.timeout(90, method="thread")
@pytest.mark.parametrize("pipes", [True, False])
def test_a_missing_hand_off_on_the_ids_path_is_a_named_stall(model_dir, monkeypatch, pipes):
    """Law 3 with ids crossing: stage 1 is sent one of a plan's two micro-batches; rank 0's
    wait for the ids and stage 1's hidden receive both end in the group's deadline, named
    with every rank's position."""
    from phaseflip.distributed.watchdog import DistributedStallError

    if not pipes:
        monkeypatch.setenv(NO_STAGE_PIPES_ENV, "1")
    with pp2_losing_a_micro_batch(model_dir, max_total_tokens=2048, dist_timeout_s=3) as (
            core, batch):
        runner = core.runner
        spec = core.sampling.last_stage_spec(batch, ahead=False)
        assert runner.last_stage_samples and spec is not None
        with pytest.raises(DistributedStallError) as err:
            runner.launch(batch.plan, None, spec)()
        msg = str(err.value)
        assert "rank 0: step 1, recv sampled ids from rank 1" in msg
        assert "rank 1: step 1, recv hidden of micro-batch 1 from rank 0" in msg
