"""PP decode groups in flight across steps (`--pp-async-decode`, issue 16 item 5).

The running requests decode in pp_size groups, each its own step; rank 0 keeps up to pp_size
launched steps in flight and samples the oldest, whose requests form the next step. The oracle
is one process: greedy tokens and finish reasons equal, over prompts that mix lengths, shared
prefixes, chunked prefill, early finishes on a stop id, n > 1 and retraction. Every test that
spawns ranks runs under a deadline (a deadlock fails, never hangs).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from phaseflip import Engine, SamplingParams
from phaseflip.distributed.driver import IN_FLIGHT_LOGITS_BYTES, DistributedRunner, _AwaitedLogits
from phaseflip.distributed.group import NO_STAGE_PIPES_ENV, DistSpec, logits_groups
from phaseflip.scheduler.request import Req
from phaseflip.scheduler.scheduler import Scheduler
from tests.conftest import build_model, pp2_losing_a_micro_batch, prompts_for

SPAWNS = pytest.mark.timeout(300, method="thread")  # signals cannot interrupt gloo


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """5 layers, so pp=3 splits unevenly (2+2+1); 4 KV heads for tp=2."""
    return build_model(tmp_path_factory.mktemp("deep") / "llama5", "llama",
                       num_hidden_layers=5, num_key_value_heads=4)


def _requests(stop: int | None) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = prompts_for(300) * 2 + prompts_for(300, seed=1, shared=False)
    params = [SamplingParams(temperature=0, max_new_tokens=5 + 3 * (i % 4), n=1 + (i % 5 == 0),
                             stop_token_ids=[stop] if stop is not None and i % 3 == 1 else [])
              for i in range(len(prompts))]
    return prompts, params


def _generate(model_dir, prompts, params, batches=None, events=None, **cfg):
    """Outputs, the most steps seen in flight at once (sampled from `_launched`) and the
    retractions; `batches`: several (prompts, params) one after the other on one engine.
    `events`: gets rank 0's ("exec", step) per plan it runs, in order."""
    cfg = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
           "dist_timeout_s": 60, "check_accounting": True} | cfg
    with Engine(str(model_dir), **cfg) as e:
        core, depth = e.core, [0]
        sample_oldest = core._sample_oldest

        def counted(sample_oldest=sample_oldest):
            depth[0] = max(depth[0], len(core._launched))
            return sample_oldest()

        core._sample_oldest = counted
        stage, wholes = getattr(core.runner, "stage", None), []
        if stage is not None:
            execute = stage.execute

            def recorded(*args, execute=execute):
                wholes.append(args[4] if len(args) > 4 else False)
                return execute(*args)

            stage.execute = recorded
            if events is not None:
                def executed(step, *args, execute=stage.execute):
                    events.append(("exec", step))
                    return execute(step, *args)

                stage.execute = executed
        got = []
        for batch_prompts, batch_params in batches or [(prompts, params)]:
            outs = e.generate(batch_prompts, batch_params, use_tqdm=False)
            got += [[(s.token_ids, s.finish_reason) for s in o.outputs] for o in outs]
            e.pool_accounting()
        assert not core._launched and core._inflight is None
        if core.hicache is not None:
            assert core.hicache.stats.host_hit_tokens > 0, "nothing came from the host tier"
        if depth[0] > 1:  # decode groups ran whole on rank 0's stage (none cut)
            assert any(wholes)
        elif wholes:
            assert not any(wholes)
        return got, depth[0], core.scheduler.stats.retractions


@pytest.fixture(scope="module")
def oracle(deep_dir):
    """One process's outputs, and a stop id that ends some requests early."""
    prompts, params = _requests(None)
    first, _, _ = _generate(deep_dir, prompts, params)
    mids = [t for out in first for toks, _ in out for t in toks[2:6]]
    stop = max(set(mids), key=mids.count)
    prompts, params = _requests(stop)
    cache = {}

    def want(**cfg):
        key = tuple(sorted(cfg.items()))
        if key not in cache:
            cache[key] = _generate(deep_dir, prompts, params, **cfg)[0]
        return cache[key]

    return prompts, params, want


@SPAWNS
@pytest.mark.parametrize("tp, pp, cfg", [
    (1, 2, {}),
    (1, 2, {"chunked_prefill_size": 8, "max_running_requests": 5}),
    (1, 2, {"max_total_tokens": 96, "page_size": 4}),  # retraction of launched requests
    (1, 3, {}),
    (2, 2, {"max_running_requests": 6}),
])
def test_decode_groups_in_flight_equal_one_process(deep_dir, oracle, tp, pp, cfg):
    prompts, params, want = oracle
    got, depth, retractions = _generate(deep_dir, prompts, params, tp_size=tp, pp_size=pp,
                                        pp_async_decode=True, **cfg)
    assert got == want(**cfg)
    assert any(r == "stop" for out in got for _, r in out)  # early finishes happened
    assert depth == pp, f"at most {depth} steps in flight, want {pp}"
    if cfg.get("max_total_tokens", 4096) < 200:
        assert retractions > 0


@SPAWNS
@pytest.mark.parametrize("tp, pp, cfg", [
    (1, 2, {}),
    (2, 2, {"max_running_requests": 6}),
])
def test_decode_groups_without_stage_pipes_equal_one_process(deep_dir, oracle, monkeypatch,
                                                            tp, pp, cfg):
    """The path NCCL takes, forced on gloo: hidden states by point-to-point, the logits on
    their own group (rank 0 and the last stage's TP rank 0), each step's receive posted by
    rank 0 into a buffer of its own when it launches the step, before the next step's
    stage-0 forward (on NCCL a receive posted later waits for that forward), and no send
    that blocks the last stage. Same tokens as one process, pp_size steps in flight."""
    monkeypatch.setenv(NO_STAGE_PIPES_ENV, "1")
    prompts, params, want = oracle
    events: list[tuple[str, int]] = []

    def irecv(*args, _irecv=dist.irecv, **kwargs):  # rank 0's: this process's
        events.append(("recv", dist.get_world_size(kwargs["group"])))  # the logits' group
        return _irecv(*args, **kwargs)

    monkeypatch.setattr(dist, "irecv", irecv)
    got, depth, _ = _generate(deep_dir, prompts, params, events=events, tp_size=tp,
                              pp_size=pp, pp_async_decode=True, **cfg)
    assert got == want(**cfg)
    assert depth == pp, f"at most {depth} steps in flight, want {pp}"
    execs = [i for i, (what, _) in enumerate(events) if what == "exec"]
    assert execs and all(events[i + 1] == ("recv", 2) for i in execs), events


@pytest.mark.parametrize("rank, want", [
    (0, {(2, 2): "0+2", (1, 4): "0+3"}),
    (1, {(2, 2): None, (1, 4): None}),
    (2, {(2, 2): "0+2", (1, 4): None}),
    (3, {(2, 2): None, (1, 4): "0+3"}),
])
def test_every_pp_layout_has_a_logits_group_made_at_launch(monkeypatch, rank, want):
    """A group per PP layout, rank 0 and the last stage's TP rank 0, made by every rank in
    the same order whether it is in it or not (a torch.distributed requirement)."""
    made = []
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append(ranks) or
                        "+".join(map(str, ranks)))
    spec = DistSpec(4, 4, 1, "", "gloo", 1.0, 4, 0, layouts=((4, 1), (2, 2), (1, 4)))
    assert logits_groups(rank, spec, None) == want  # none for tp4 (no pipeline)
    assert made == [[0, 2], [0, 3]]


@pytest.mark.timeout(90, method="thread")
def test_a_missing_hand_off_without_stage_pipes_is_a_named_stall(deep_dir, monkeypatch):
    """Law 3 on the point-to-point path: stage 1 is sent one of a plan's two micro-batches;
    rank 0's logits receive (posted at launch, waited on its own group) and stage 1's hidden
    receive both end in the group's deadline, named with every rank's position."""
    from phaseflip.distributed.watchdog import DistributedStallError

    monkeypatch.setenv(NO_STAGE_PIPES_ENV, "1")
    with pp2_losing_a_micro_batch(deep_dir, max_total_tokens=4096, dist_timeout_s=3) as (
            core, batch):
        runner = core.runner
        assert runner.stage.pipes is None
        with pytest.raises(DistributedStallError) as err:
            runner.launch(batch.plan)()
        msg = str(err.value)
        assert "rank 0: step 1, recv logits from rank 1" in msg
        assert "rank 1: step 1, recv hidden of micro-batch 1 from rank 0" in msg


@SPAWNS
def test_flag_off_keeps_one_step_in_flight(deep_dir, oracle):
    """The default path: each launched step is sampled in the step that launched it."""
    prompts, params, want = oracle
    got, depth, _ = _generate(deep_dir, prompts[:4], params[:4], pp_size=2)
    assert depth == 1


@SPAWNS
def test_decode_groups_with_hicache_equal_the_synchronous_path(llama_dir):
    """HiCache orders ride the messages of steps in flight; a small pool makes the device
    tree evict, so the repeated prompts come back from the host tier."""
    prompts = prompts_for(300) * 2
    evict = [p for seed in (1, 2, 3) for p in prompts_for(300, seed, shared=False)]
    params = [SamplingParams(temperature=0, max_new_tokens=6 + 3 * (i % 4), n=1 + (i % 5 == 0))
              for i in range(len(prompts))]
    batches = [(b, params[: len(b)]) for b in (prompts, evict, prompts)]  # the last: host
    cfg = {"pp_size": 2, "enable_hicache": True, "hicache_page_size": 4,
           "hicache_host_gb": 0.01, "max_total_tokens": 240}
    want, _, _ = _generate(llama_dir, None, None, batches, **cfg, overlap_schedule=False)
    got, depth, _ = _generate(llama_dir, None, None, batches, **cfg, pp_async_decode=True)
    assert got == want
    assert depth == 2


@SPAWNS
def test_a_flip_drains_every_group_in_flight(llama_dir):
    """tp2 → pp2 → tp2 → pp2 with decode groups in flight at the seams: the seam samples
    every launched step first (none is lost or doubled), the pool balances after each seam,
    and each output equals one process's."""
    prompts = prompts_for(300) * 2
    params = SamplingParams(temperature=0, max_new_tokens=14, ignore_eos=True)
    with Engine(str(llama_dir), device="cpu", dtype="float32", max_total_tokens=4096) as e:
        want = [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]
    flips, in_flight = {3: (1, 2), 9: (2, 1), 12: (1, 2)}, []
    with Engine(str(llama_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                dist_timeout_s=60, check_accounting=True, tp_size=2, enable_flip=True,
                enable_hicache=True, hicache_host_gb=0.01, pp_async_decode=True) as e:
        core = e.core
        for i, p in enumerate(prompts):
            core.add_request(f"r{i}", p, params)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        ends: dict[str, list[str]] = {k: [] for k in got}
        step = 0
        while core.has_work():
            deltas = []
            if step in flips:
                in_flight.append(len(core._launched))
                deltas = core.flip(*flips[step])[1]
                assert not core._launched and core._inflight is None
                core.check_pool()
            for d in deltas + core.step():
                got[d.request_id] += d.token_ids
                if d.finish_reason is not None:
                    ends[d.request_id].append(d.finish_reason)
            step += 1
        core.check_pool()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert all(r == ["length"] for r in ends.values())  # finished once: none lost or doubled
    # between steps a pp2 engine holds one launched step unsampled (and one sampled)
    assert max(in_flight) == 1, in_flight


@SPAWNS
def test_aborts_of_launched_and_sampled_groups_leave_an_exact_pool(deep_dir):
    """Requests aborted while their group's step is launched (logits not received) or
    sampled (token on the device): the launched steps are still received in order, nothing
    is owed to the aborted requests, the others finish, and the pool balances at idle."""
    with Engine(str(deep_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                dist_timeout_s=60, check_accounting=True, pp_size=2,
                pp_async_decode=True) as e:
        core = e.core
        params = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
        for i, p in enumerate(prompts_for(300) * 2):
            core.add_request(f"r{i}", p, params)
        for _ in range(8):
            core.step()
        launched = {it.req.rid.split("#")[0] for batch, _ in core._launched
                    for it in batch.items}
        sampled = {it.req.rid.split("#")[0] for it in core._inflight.items}
        assert launched and sampled and not launched & sampled
        gone = {min(launched), min(sampled)}
        for rid in gone:
            core.abort(rid)
        finished = {}
        while core.has_work():
            for d in core.step():
                if d.finish_reason:
                    finished[d.request_id] = d.finish_reason
        core.kv.check(core.scheduler.running)
        want = {f"r{i}": "length" for i in range(len(prompts_for(300) * 2))}
        assert finished == {k: v for k, v in want.items() if k not in gone}


@SPAWNS
def test_streaming_with_decode_groups(deep_dir):
    """The engine thread's loop (steps with a sink) under decode groups in flight."""
    prompts = prompts_for(300)[:5]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    with Engine(str(deep_dir), device="cpu", dtype="float32", max_total_tokens=4096) as e:
        want = [o.outputs[0].token_ids for o in e.generate(prompts, params, use_tqdm=False)]
    with Engine(str(deep_dir), device="cpu", dtype="float32", max_total_tokens=4096,
                pp_size=2, pp_async_decode=True, dist_timeout_s=60) as e:
        async def one(p):
            ids = []
            async for d in e.generate_stream(p, params):
                ids += d.token_ids
            return ids

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        assert asyncio.run(main()) == want


@SPAWNS
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2)])
def test_decode_groups_on_one_gpu_match_single_process(deep_dir, oracle, tp, pp):
    """Ranks sharing one GPU over gloo with host staging (decode graphs per stage, tokens
    sampled on the device, stage 0's TP ranks get them by a broadcast): the same greedy
    tokens as one GPU process, with pp_size steps in flight."""
    prompts, params, _ = oracle
    cfg = {"device": "cuda", "dist_backend": "gloo"}
    want, _, _ = _generate(deep_dir, prompts, params, device="cuda")
    got, depth, _ = _generate(deep_dir, prompts, params, tp_size=tp, pp_size=pp,
                              pp_async_decode=True, **cfg)
    assert got == want
    assert depth == pp


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@SPAWNS
@pytest.mark.gpu
@pytest.mark.parametrize("tp, pp", [
    pytest.param(1, 2, marks=pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")),
    pytest.param(2, 2, marks=pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA devices")),
])
def test_decode_groups_over_nccl_match_one_gpu(deep_dir, oracle, tp, pp):
    """One rank per GPU over NCCL (no stage pipes: the logits on their own communicator):
    the same greedy tokens as one GPU process, with pp_size steps in flight."""
    prompts, params, _ = oracle
    want, _, _ = _generate(deep_dir, prompts, params, device="cuda")
    got, depth, _ = _generate(deep_dir, prompts, params, tp_size=tp, pp_size=pp,
                              pp_async_decode=True, device="cuda", dist_backend="nccl")
    assert got == want
    assert depth == pp


# ----------------------------------------------------------------- scheduler: the groups
def _req(i: int, pending: int = 0) -> Req:
    r = Req(rid=f"r{i}", prompt_ids=[1, 2], params=SamplingParams(max_new_tokens=9),
            eos_ids=(0,), arrival=i)
    r.output_ids, r.kv_len, r.pending = [3] * (1 - pending), 2, pending
    return r


def test_a_step_decodes_one_group_host_tokens_first():
    """ceil(running / groups) requests per step; those left out before (token on the host)
    go first, in running order."""
    sched = Scheduler(SimpleNamespace(), None, 64)
    sched.running = [_req(0, 1), _req(1, 1), _req(2, 0), _req(3, 1), _req(4, 0)]
    got = sched._decode_group(list(sched.running), 2)
    assert [r.rid for r in got] == ["r0", "r2", "r4"]
    assert sched._decode_group(sched.running[:2], 2) == sched.running[:2]


def test_a_launched_request_is_not_decoding_or_readmitted():
    """A launched step's requests (advanced, not sampled) have no token to feed; retracted,
    they wait until their token is sampled (as a pending one does)."""
    r = _req(0, 0)
    r.kv_len, r.launched = 3, True
    assert r.remaining == 0


# ----------------------------------------------------------------- driver: the logits pipe
def _runner(depth: int, capacity: int, awaited_bytes: list[int], held: int = 0):
    runner = object.__new__(DistributedRunner)
    runner.decode_depth, runner._held_bytes = depth, held
    runner.stage = SimpleNamespace(pipes=SimpleNamespace(capacity=capacity))
    runner._awaited = [_AwaitedLogits(runner, lambda: None, i, n)
                       for i, n in enumerate(awaited_bytes)]
    return runner


@pytest.mark.parametrize("depth, awaited, held, fence, want", [
    (2, [], 0, False, True),  # nothing in flight
    (1, [100], 0, False, False),  # the default: the launched step's logits first
    (2, [100], 0, False, True),
    (2, [100], 0, True, False),  # a fence waits on every rank: nothing may be unread
    (2, [600], 500, False, False),  # the last stage could block on a full logits pipe
    (2, [500], 500, False, True),
])
def test_a_message_overlaps_only_while_the_logits_pipe_cannot_fill(depth, awaited, held,
                                                                    fence, want):
    runner = _runner(depth, 1000, awaited, held)
    plan = SimpleNamespace(num_tokens=4, batch_size=4)
    assert runner._may_overlap(plan, fence) is want
    assert runner._may_overlap(None, False) is (not awaited)
    # a synchronous step reads its logits at once: nothing launched may be left unread
    assert runner._may_overlap(plan, fence, defer=False) is (not awaited)


@pytest.mark.parametrize("async_on, pipes, rows, want", [
    (False, True, 8, 1),
    (True, True, 8, 2),
    (True, False, 8, 2),  # NCCL / across nodes: logits in buffers of their own
    (True, True, 4096, 1),  # 3 groups of logits would not fit the pipe
    (True, False, 1 << 20, 1),  # ... nor the budget for logits in flight
])
def test_decode_depth(async_on, pipes, rows, want):
    runner = object.__new__(DistributedRunner)
    runner.runner = SimpleNamespace(model_cfg=SimpleNamespace(vocab_size=1000))
    runner.stage = SimpleNamespace(pipes=SimpleNamespace(capacity=1 << 20) if pipes else None)
    cfg = SimpleNamespace(pp_async_decode=async_on, pp_size=2, max_running_requests=rows)
    assert runner._decode_depth(cfg) == want


def test_without_pipes_a_message_overlaps_within_the_budget():
    """No stage pipes (NCCL): the in-flight logits budget bounds the unread bytes."""
    runner = _runner(2, 0, [100], 0)
    runner.stage.pipes = None
    plan = SimpleNamespace(num_tokens=4, batch_size=4)
    assert runner._may_overlap(plan, False) is True
    runner._held_bytes = IN_FLIGHT_LOGITS_BYTES
    assert runner._may_overlap(plan, False) is False


def _mixed_run(model_dir, **cfg) -> tuple[dict[str, list[int]], list[float]]:
    """Two greedy requests (one chunked by 8) and, once a launched step with no sampling rows
    is in flight, a logprobs request (which cannot overlap: a synchronous step). The tokens
    by request, and the logprobs request's logprobs."""
    base = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096,
            "dist_timeout_s": 60, "chunked_prefill_size": 8}
    with Engine(str(model_dir), **(base | cfg)) as e:
        core = e.core
        greedy = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
        lp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True, logprobs=1)
        core.add_request("a", prompts_for(300)[1], greedy)
        core.add_request("b", prompts_for(300)[3], greedy)
        got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
        logprobs: list[float] = []
        added, step = False, 0
        while core.has_work():
            awaited = getattr(core.runner, "_awaited", None) or []
            if not added and (any(a.nbytes == 8 for a in awaited) or step == 3):
                core.add_request("c", prompts_for(300)[0], lp)
                added = True
            for d in core.step():
                got[d.request_id] += d.token_ids
                logprobs += d.logprobs or []
            step += 1
        assert added
    return got, logprobs


@pytest.mark.timeout(240, method="thread")
def test_a_synchronous_step_after_launched_ones_reads_its_own_logits(deep_dir, monkeypatch):
    """A step that cannot overlap (logprobs) sent while a launched step's logits (here a
    chunk-only step's empty frame) are unread: it used to read that frame as its own —
    uninitialised logits, then stale ones, then a shape error that closed the ranks. The
    tokens now equal one process's, on the stage pipes and on the point-to-point path (whose
    receives are matched in order on the logits' group), and their logprobs too."""
    want, want_lp = _mixed_run(deep_dir)
    got, lp = _mixed_run(deep_dir, pp_size=2, pp_async_decode=True)
    assert got == want and len(lp) == 4 and lp == pytest.approx(want_lp, rel=1e-5)
    monkeypatch.setenv(NO_STAGE_PIPES_ENV, "1")  # the point-to-point path: the very same
    assert _mixed_run(deep_dir, pp_size=2, pp_async_decode=True) == (got, lp)


@pytest.mark.timeout(240, method="thread")
def test_the_flip_policy_hears_the_decode_groups_a_step_really_had(deep_dir):
    """The decode SLO multiplies a step's time by the decode groups taking turns: 1 for
    synchronous steps (a logprobs request) and for a lone request, the groups in flight
    otherwise — not the configured depth (which read steps 2x too slow and flipped back)."""
    flip = {"enable_flip": True, "enable_hicache": True, "hicache_host_gb": 0.01}
    with Engine(str(deep_dir), pp_size=2, pp_async_decode=True, flip_weights="reload",
                device="cpu", dtype="float32", max_total_tokens=4096, dist_timeout_s=60,
                **flip) as e:
        core = e.core
        policy = core.flip_telemetry.policy
        seen: list[int] = []
        observe = policy.observe_step
        policy.observe_step = lambda *a, **k: seen.append(a[4]) or observe(*a, **k)
        cases = [([SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                  logprobs=0)] * 3, {1}),
                 ([SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)], {1}),
                 ([SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)] * 4,
                  {1, 2})]
        for n, (params, want) in enumerate(cases):
            seen.clear()
            for i, p in enumerate(params):
                core.add_request(f"c{n}-{i}", prompts_for(300)[i][:12], p)
            while core.has_work():
                core.step()
            assert set(seen) == want, (n, seen)
