"""Overlap scheduling: step k+1 is scheduled and launched before step k's tokens reach the host.

The oracle is the same engine with overlap off: greedy tokens, finish reasons and texts must be
identical, including requests that finish early on a stop id (whose next row was already
scheduled and is wasted), length finishes at max_model_len, retraction, chunked prefill,
prefix hits, n > 1, aborts, and requests that force synchronous steps in between.
"""

from __future__ import annotations

import pytest
import torch

from phaseflip import SamplingParams
from tests.conftest import no_host_reads, prompts_for

CFG = {"max_total_tokens": 4096, "check_accounting": True}


def _run(make_engine, model_dir, requests, overlap: bool, **cfg):
    engine = make_engine(model_dir, overlap_schedule=overlap, **(CFG | cfg))
    outs = engine.generate([r[0] for r in requests], [r[1] for r in requests], use_tqdm=False)
    return engine, [[(s.token_ids, s.finish_reason, s.text) for s in o.outputs] for o in outs]


def _stop_id(make_engine, model_dir, prompts) -> int:
    """A token the greedy outputs produce mid-way, to end some requests early."""
    e = make_engine(model_dir, **CFG)
    outs = e.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12), use_tqdm=False)
    mids = [t for o in outs for t in o.outputs[0].token_ids[2:8]]
    return max(set(mids), key=mids.count)


@pytest.mark.parametrize("cfg", [
    {},
    {"chunked_prefill_size": 8, "max_running_requests": 3},
    {"max_total_tokens": 160, "page_size": 4},  # retraction
])
def test_greedy_outputs_equal_the_synchronous_engine(make_engine, llama_dir, cfg):
    prompts = prompts_for(300) * 2
    stop = _stop_id(make_engine, llama_dir, prompts)
    params = [SamplingParams(temperature=0, max_new_tokens=4 + 3 * (i % 5),
                             stop_token_ids=[stop] if i % 2 else [], n=1 + (i % 3 == 0))
              for i in range(len(prompts))]
    requests = list(zip(prompts, params))
    _, want = _run(make_engine, llama_dir, requests, False, **cfg)
    engine, got = _run(make_engine, llama_dir, requests, True, **cfg)
    assert got == want
    assert any(r == "stop" for out in got for _, r, _ in out)  # early finishes happened
    if cfg.get("max_total_tokens", 4096) < 200:
        assert engine.core.scheduler.stats.retractions > 0


def test_steps_run_ahead_only_for_requests_that_allow_it(make_engine, llama_dir):
    """Logprobs, penalties and stop strings need the host between steps: mixing them in makes
    the engine alternate between overlapped and synchronous steps, with the same outputs."""
    prompts = prompts_for(300)
    params = [SamplingParams(temperature=0, max_new_tokens=10),
              SamplingParams(temperature=0, max_new_tokens=6, logprobs=2),
              SamplingParams(temperature=0, max_new_tokens=10, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_new_tokens=10, stop=["zz"]),
              SamplingParams(temperature=0, max_new_tokens=12)] + [
              SamplingParams(temperature=0, max_new_tokens=8)] * (len(prompts) - 5)
    requests = list(zip(prompts, params))
    _, want = _run(make_engine, llama_dir, requests, False, max_running_requests=3)
    engine, got = _run(make_engine, llama_dir, requests, True, max_running_requests=3)
    assert got == want
    assert engine.core._inflight is None


def test_length_finish_at_max_model_len(make_engine, llama_dir):
    """The pending token that reaches max_model_len is never scheduled past the table."""
    prompt = prompts_for(300)[3]
    params = SamplingParams(temperature=0, max_new_tokens=48 - len(prompt), ignore_eos=True)
    _, want = _run(make_engine, llama_dir, [(prompt, params)], False, max_model_len=48)
    _, got = _run(make_engine, llama_dir, [(prompt, params)], True, max_model_len=48)
    assert got == want and got[0][0][1] == "length"
    assert len(prompt) + len(got[0][0][0]) == 48


def test_sampling_runs_ahead_with_valid_outputs(make_engine, llama_dir):
    """Random sampling (unseeded) may draw differently once rows are wasted, so only the
    shape of the outputs is compared."""
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=9, ignore_eos=True)
    engine, got = _run(make_engine, llama_dir, [(p, params) for p in prompts], True)
    assert all(len(ids) == 9 and reason == "length" for out in got for ids, reason, _ in out)


def test_abort_with_a_token_in_flight(make_engine, llama_dir):
    engine = make_engine(llama_dir, overlap_schedule=True, **CFG)
    core = engine.core
    params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    for i, p in enumerate(prompts_for(300)[:4]):
        core.add_request(f"r{i}", p, params)
    for _ in range(4):
        core.step()
    assert core._inflight is not None
    core.abort("r1")
    finished = {}
    while core.has_work():
        for d in core.step():
            if d.finish_reason:
                finished[d.request_id] = d.finish_reason
    assert finished == {"r0": "length", "r2": "length", "r3": "length"}
    core.kv.check(core.scheduler.running)


def test_sampling_on_device_reads_nothing_back():
    """A run-ahead step samples without a host sync; a device `.any()` deciding whether the
    top-k/top-p/min-p filters are on made every temperature > 0 step wait for the GPU (seen on
    the H200: overlap bought 3 % at temperature 1)."""
    from phaseflip.sampling.sampler import Sampler, SamplingInput

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, min_p=0.1,
                                                            top_k=5)]
    inputs = [SamplingInput(p, [1, 2], [], [0]) for p in params]
    with no_host_reads():
        tokens = Sampler(seed=0).sample_on_device(logits, inputs)
    assert tokens.shape == (4,)


@pytest.mark.parametrize("ids, want", [
    ([-1, -2, -3], [50, 51, 52]),  # a decode step: every id a placeholder, rows in order
    ([-2, 7, -1, 5, 6], [51, 7, 50, 5, 6]),  # a mixed step
    ([4, 5, 6], [4, 5, 6]),  # nothing in flight
])
def test_placeholders_resolve_from_host_indices(ids, want):
    """The plan knows on the host where its placeholders are, so filling them needs no device
    comparison; the result equals the device-side resolution."""
    from phaseflip.forward_batch import ForwardBatch

    table = torch.arange(40, dtype=torch.int64).reshape(4, 10)
    ext = [1] * 3 if len(ids) == 3 else [1, 1, 3]
    plan = ForwardBatch.from_table(table, list(range(len(ext))), [2] * len(ext), ext, ids,
                                   [len(ids) - 1])
    future = torch.tensor([50, 51, 52])
    with no_host_reads():
        got = plan.with_future_tokens(future).input_ids
    assert got.tolist() == want
    plan.future_pos = None  # the device-side fallback agrees
    assert plan.with_future_tokens(future).input_ids.tolist() == want


@pytest.mark.timeout(300, method="thread")  # gloo ranks: a deadlock fails, never hangs
@pytest.mark.parametrize("tp, pp, share", [(1, 1, "message"), (2, 1, "message"),
                                           (2, 1, "broadcast"), (1, 2, "message"),
                                           (2, 2, "broadcast")])
def test_run_ahead_on_tp_and_pp_with_hicache_equals_the_synchronous_path(
        make_engine, llama_dir, tp, pp, share):
    """Every layout runs ahead with HiCache on (issue 16 item 1): stage 0's TP ranks get the
    placeholders' tokens from rank 0 (in the message on a CPU; "broadcast": as from a GPU,
    by a broadcast on their TP group), HiCache orders ride the same messages. A small pool
    makes the device tree evict, so repeated prompts are served from the host tier; some
    requests end early on a stop id (their next row was already planned on every rank)."""
    prompts = prompts_for(300) * 3
    evict = [p for seed in (1, 2, 3) for p in prompts_for(300, seed, shared=False)]
    stop = _stop_id(make_engine, llama_dir, prompts[:7])
    params = [SamplingParams(temperature=0, max_new_tokens=6 + 3 * (i % 4),
                             stop_token_ids=[stop] if i % 3 == 1 else [], n=1 + (i % 5 == 0))
              for i in range(len(prompts))]
    cfg = {"tp_size": tp, "pp_size": pp, "enable_hicache": True, "hicache_page_size": 4,
           "hicache_host_gb": 0.01, "max_total_tokens": 240, "dist_timeout_s": 60}
    outs, ahead = {}, {}
    for overlap in (False, True):
        engine = make_engine(llama_dir, overlap_schedule=overlap, **cfg)
        core, calls = engine.core, [0]
        step_ahead = core._step_ahead

        def counted(sink, step_ahead=step_ahead, calls=calls):
            calls[0] += 1
            return step_ahead(sink)

        core._step_ahead = counted
        if share == "broadcast":
            core.runner.tokens_on_host = lambda future: None
        outs[overlap] = []
        for batch in (prompts, evict, prompts):  # the last from the host tier
            got = engine.generate(batch, params[: len(batch)], use_tqdm=False)
            outs[overlap] += [[(s.token_ids, s.finish_reason) for s in o.outputs] for o in got]
        ahead[overlap] = calls[0]
        hits = engine.core.hicache.stats.host_hit_tokens
    assert outs[True] == outs[False]
    assert any(r == "stop" for out in outs[True] for _, r in out)  # early finishes happened
    assert ahead[False] == 0 and ahead[True] > 10  # the steps did run ahead
    assert hits > 0, "nothing was served from the host tier"
