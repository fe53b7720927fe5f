"""TP, PP and TP×PP over real processes (gloo on CPU) equal the single-process engine.

Every test runs under a deadline (pytest-timeout), so a deadlock fails instead of hanging CI.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from phaseflip import Engine, SamplingParams
from tests.conftest import build_model, pp2_losing_a_micro_batch, prompts_for

pytestmark = pytest.mark.timeout(180, method="thread")  # signals cannot interrupt gloo
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """5 layers, so pp=3 splits unevenly (2+2+1); 4 KV heads for tp=2 and tp=4."""
    return build_model(tmp_path_factory.mktemp("deep") / "llama5", "llama",
                       num_hidden_layers=5, num_key_value_heads=4)


def run(model_dir, prompts, params=GREEDY, **cfg) -> list[list[int]]:
    cfg = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
           "dist_timeout_s": 60, "check_accounting": True} | cfg
    with Engine(str(model_dir), **cfg) as e:
        outs = e.generate(prompts, params, use_tqdm=False)
        e.pool_accounting()
        if cfg.get("max_total_tokens", 4096) < 200:
            assert e.core.scheduler.stats.retractions > 0
        return [[o.token_ids for o in out.outputs] for out in outs]


@pytest.fixture(scope="module")
def reference(deep_dir):
    cache = {}

    def ref(prompts, params=GREEDY, **cfg):
        key = (tuple(map(tuple, prompts)), repr(params), tuple(sorted(cfg.items())))
        if key not in cache:
            cache[key] = run(deep_dir, prompts, params, **cfg)
        return cache[key]

    return ref


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (1, 3), (2, 2)])
def test_layouts_match_single_process(tp, pp, deep_dir, reference):
    prompts = prompts_for(300)
    want = reference(prompts)
    assert run(deep_dir, prompts, tp_size=tp, pp_size=pp) == want
    # prefix-cache hits, small prefill chunks, pages of 4
    again = run(deep_dir, prompts + prompts[::-1], tp_size=tp, pp_size=pp,
                chunked_prefill_size=5, page_size=4)
    assert again == want + want[::-1]


def test_retraction_and_n_samples_under_tp_pp(deep_dir, reference):
    prompts = prompts_for(300, shared=False)
    assert run(deep_dir, prompts * 2, tp_size=2, pp_size=2, max_total_tokens=56,
               chunked_prefill_size=16) == reference(prompts) * 2
    sampled = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=11, ignore_eos=True)
    assert run(deep_dir, prompts[:2], sampled, tp_size=2, pp_size=2) == reference(
        prompts[:2], sampled)


@pytest.mark.parametrize("arch", ["qwen3", "llama-tied-mqa"])
def test_architectures_under_tp_and_pp(arch, model_dirs):
    """Qwen3 q/k norms shard per head; MQA replicates its one KV head across TP ranks; a tied
    LM head on the last stage loads the embedding rows."""
    prompts = prompts_for(300)[:4]
    want = run(model_dirs[arch], prompts)
    assert run(model_dirs[arch], prompts, tp_size=2) == want
    assert run(model_dirs[arch], prompts, pp_size=2) == want


def test_streaming_under_tp(deep_dir, reference):
    prompts = prompts_for(300)[:3]
    with Engine(str(deep_dir), device="cpu", max_total_tokens=4096, tp_size=2,
                dist_timeout_s=60) as e:
        async def one(p):
            ids = []
            async for d in e.generate_stream(p, GREEDY):
                ids += d.token_ids
            return [ids]

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(main()) == reference(prompts)


@pytest.mark.timeout(90, method="thread")
def test_broken_plan_is_a_named_stall_not_a_hang(deep_dir):
    """The driver broadcasts a plan of two micro-batches but sends stage 1 only the first:
    stage 1 waits for a micro-batch nobody sends. The group timeout turns that into an error
    naming every rank's position, well within the test deadline."""
    from phaseflip.distributed.watchdog import DistributedStallError

    with pp2_losing_a_micro_batch(deep_dir, max_total_tokens=4096, dist_timeout_s=5) as (
            core, batch):
        plan = batch.plan
        assert plan.batch_size >= 2
        start = time.monotonic()
        with pytest.raises(DistributedStallError) as err:
            core.runner.forward(plan)
        msg = str(err.value)
        assert time.monotonic() - start < 30
        assert "rank 0: step 1, recv logits from rank 1" in msg
        assert "rank 1: step 1, recv hidden of micro-batch 1 from rank 0" in msg


def _descendants(pid: int) -> list[int]:
    import subprocess

    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [d for k in kids for d in _descendants(k)]


def test_server_with_tp2_answers_like_tp1():
    import httpx

    from tests.server_process import start_server, stop_server

    body = {"model": "tiny-llama", "prompt": ["Return the", "def main():", "The default"],
            "max_tokens": 10, "temperature": 0}
    texts = []
    for args in ((), ("--tp-size", "2")):
        proc, url = start_server(*args)
        try:
            r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
            texts.append([c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])])
        finally:
            stop_server(proc)
    assert texts[0] == texts[1] and all(texts[0])


def test_killing_a_worker_stops_the_server_and_every_rank():
    import os
    import signal

    from tests.server_process import alive, rank_pids, start_server, stop_server

    proc, url = start_server("--tp-size", "2", "--pp-size", "2")
    try:
        ranks = [p for p in _descendants(proc.pid)  # the engine, its rank forkserver, ranks
                 if b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
        workers = rank_pids(proc.pid)
        assert len(workers) == 3, ranks  # ranks 1..3 (rank 0 is the engine process)
        os.kill(workers[1], signal.SIGKILL)
        proc.wait(timeout=30)  # the engine notices at its next idle check, the server exits
        deadline = time.monotonic() + 15
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in ranks if alive(p)], "orphaned ranks"
    finally:
        if proc.poll() is None:
            stop_server(proc)


# (two nodes on loopback, answers equal to one process's: test_multi_node_edges.py)


@pytest.mark.timeout(90, method="thread")
def test_idle_ranks_outlive_the_group_timeout(deep_dir):
    """An idle server sends its ranks nothing: they must wait for the next plan past
    --dist-timeout-s (with the deadline on that wait, every tp/pp server died after two idle
    minutes), and the group still serves afterwards."""
    prompts = prompts_for(300)[:2]
    want = run(deep_dir, prompts)
    with Engine(str(deep_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                tp_size=2, dist_timeout_s=2) as e:
        first = e.generate(prompts, GREEDY, use_tqdm=False)
        time.sleep(5)  # idle for 2.5 group timeouts
        e.core.check_alive()  # a worker that timed out has exited by now
        again = e.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == want_flat(want)
    assert [o.outputs[0].token_ids for o in again] == want_flat(want)


def want_flat(outs: list[list[list[int]]]) -> list[list[int]]:
    return [o[0] for o in outs]


@pytest.mark.timeout(90, method="thread")
def test_rank_dying_while_the_group_forms_is_a_named_error_at_once(deep_dir):
    """A worker killed before it joins: rank 0 must not wait out the store timeout (the server
    hung ~124 s with /health 200, then failed with a generic DistStoreError); it fails at once
    naming the dead rank, and no rank is left behind."""
    import multiprocessing as mp
    import os
    import signal
    import threading

    from phaseflip.distributed.group import GroupFormationError

    errors: list[BaseException] = []

    def build() -> None:
        try:
            Engine(str(deep_dir), device="cpu", max_total_tokens=4096, tp_size=2,
                   dist_timeout_s=60)
        except BaseException as e:  # noqa: BLE001 — the test inspects it
            errors.append(e)

    t = threading.Thread(target=build, daemon=True)
    t.start()
    end = time.monotonic() + 30
    while not mp.active_children() and time.monotonic() < end:
        time.sleep(0.05)
    workers = mp.active_children()
    assert workers, "no worker was spawned"
    start = time.monotonic()
    os.kill(workers[0].pid, signal.SIGKILL)
    t.join(timeout=30)
    assert not t.is_alive() and time.monotonic() - start < 10
    assert errors and isinstance(errors[0], GroupFormationError), errors
    assert "phaseflip-rank1 (exit code -9) exited while joining" in str(errors[0])
    assert "ranks not joined: [1]" in str(errors[0])
