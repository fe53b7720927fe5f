"""The phase flip's seam over real ranks (gloo on CPU): TP ⇄ PP mid-generation.

The flip's correctness bar: greedy outputs identical with and without flips, no request lost
or duplicated across any number of flips, pool accounting exact after every seam (the seam
checks it and raises), three and more cycles in a row without drift.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from phaseflip import Engine, SamplingParams
from phaseflip.cache.hicache import page_keys
from phaseflip.errors import InvalidRequestError
from phaseflip.flip.weights import shard_bytes
from phaseflip.model.config import ModelConfig
from tests.conftest import prompts_for

pytestmark = pytest.mark.timeout(240, method="thread")  # signals cannot interrupt gloo
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=0)
# PHASEFLIP_TEST_DEVICE=cuda runs these engines on the GPU(s): NCCL with one rank per GPU
CFG = {"device": os.environ.get("PHASEFLIP_TEST_DEVICE", "cpu"), "dtype": "float32",
       "max_total_tokens": 4096, "dist_timeout_s": 60, "check_accounting": True}
FLIP = {"enable_flip": True, "enable_hicache": True, "hicache_host_gb": 0.01}
PAGED = FLIP | {"hicache_page_size": 8}  # the prompts' prefixes fill whole host pages


def _drive(engine: Engine, prompts, flips: dict[int, tuple[int, int]],
           seam: Callable[[str], None] | None = None) -> tuple[dict, list]:
    """Runs the prompts step by step on the engine's core, flipping to flips[k] before step k
    (calling seam("before") and seam("after") around each flip); returns {rid: (token ids,
    logprobs, finish reasons)} and the censuses."""
    core = engine.core
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, PARAMS)
    outs: dict[str, tuple[list, list, list]] = {f"r{i}": ([], [], []) for i in range(len(prompts))}
    censuses, step = [], 0
    while core.has_work():
        deltas = []
        if step in flips:
            if seam is not None:
                seam("before")
            census, deltas = core.flip(*flips[step])
            censuses.append(census)
            if seam is not None:
                seam("after")
        for d in deltas + core.step():
            key = d.request_id if d.index == 0 else f"{d.request_id}/{d.index}"
            ids, lps, reasons = outs.setdefault(key, ([], [], []))
            ids += d.token_ids
            lps += d.logprobs or []
            if d.finish_reason is not None:
                reasons.append(d.finish_reason)
        step += 1
    core.kv.check(core.scheduler.running)
    return outs, censuses


def test_three_flip_cycles_match_the_unflipped_run(model_dirs):
    """tp2 → pp2 → tp2 → pp2 → tp2 mid-generation, the first before any decode finished and
    one while prompts are still being admitted; each output equals the single-process run."""
    prompts = prompts_for(300) * 2
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        want, _ = _drive(e, prompts, {})
    flips = {2: (1, 2), 5: (2, 1), 7: (1, 2), 11: (2, 1)}
    with Engine(str(model_dirs["llama"]), tp_size=2, max_running_requests=6, **FLIP,
                **CFG) as e:
        got, censuses = _drive(e, prompts, flips)
        assert (e.core.cfg.tp_size, e.core.cfg.pp_size) == (2, 1)
    assert [c.target for c in censuses] == ["tp1×pp2", "tp2×pp1", "tp1×pp2", "tp2×pp1"]
    for c in censuses:
        assert c.rows_moved == 0 and c.fence_s is not None and c.retracted > 0
        assert list(c.segments) == ["fence", "retract", "drop", "teardown", "relayout"]
        assert "DONE" in c.done_line() and c.worst()[0] in c.segments
    for rid, (ids, lps, reasons) in got.items():
        assert reasons == ["length"], rid  # finished exactly once: none lost, none doubled
        assert ids == want[rid][0], rid
        assert lps == pytest.approx(want[rid][1], abs=1e-4), rid


def test_rank_processes_outlive_ten_flips(model_dirs, reference):
    """A flip re-lays the same processes out (persistent ranks): the worker PIDs are the
    same after ten flips in a row as before, and every output equals the unflipped run."""
    flips = {step: ((1, 2) if step % 2 else (2, 1)) for step in range(1, 11)}
    with Engine(str(model_dirs["llama"]), tp_size=2, **PAGED, **CFG) as e:
        ranks = e.core.runner.ranks
        pids = ranks.pids()
        got, censuses = _drive(e, prompts_for(300), flips)
        assert e.core.runner.ranks is ranks and ranks.pids() == pids
        assert not ranks.exited_workers()
    assert len(censuses) == 10
    _assert_same(got, reference)


def shm_files() -> set[str]:
    """This process's shared host tiers in /dev/shm."""
    shm = Path("/dev/shm")
    return ({p.name for p in shm.glob(f"phaseflip-hicache-{os.getpid()}-*")} if shm.is_dir()
            else set())


@pytest.fixture(scope="module")
def reference(model_dirs) -> dict:
    """The unflipped single-process run of prompts_for(300)."""
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        return _drive(e, prompts_for(300), {})[0]


def _assert_same(got: dict, want: dict) -> None:
    for rid, (ids, lps, reasons) in got.items():
        assert reasons == ["length"], rid
        assert ids == want[rid][0], rid
        assert lps == pytest.approx(want[rid][1], abs=1e-4), rid


@pytest.mark.timeout(120, method="thread")
def test_rows_moved_is_unmeasured_until_the_seam_reads_the_new_pool():
    """Law 5: a census whose relayout never ran reports no rows-moved figure, not 0 (the
    flip tests' `rows_moved == 0` is then a reading of the new pool, which can fail)."""
    from phaseflip.flip.census import SeamCensus

    census = SeamCensus("tp2×pp1", "tp1×pp2", segments={"fence": 0.1})
    assert census.rows_moved is None
    assert "rows moved unmeasured" in census.done_line()
    assert census.as_dict()["rows_moved"] is None


def test_retracted_requests_are_served_from_the_host_tier_after_a_flip(model_dirs, reference):
    """Law 6's point: what the fence persisted serves the re-admission. tp2 → pp2 mid-generation
    without a disk tier: every full page of every retracted request (prompt and output so far)
    comes back from host memory, loaded once, and the outputs equal the unflipped run."""
    with Engine(str(model_dirs["llama"]), tp_size=2, **PAGED, **CFG) as e:
        core = e.core
        hc, frames = core.hicache, core.hicache.host.frames
        seen: dict[str, object] = {}

        def seam(when: str) -> None:
            if when == "before":
                assert not core.scheduler.waiting and core.scheduler.running
                seen["hits"] = hc.stats.host_hit_tokens
                keys = {k for r in core.scheduler.running
                        for k in page_keys(r.all_ids[:-1], hc.page_size, hc.fingerprint)}
                seen["want_hits"] = hc.page_size * len(keys)

        got, censuses = _drive(e, prompts_for(300), {4: (1, 2)}, seam)
        assert censuses[0].retracted == len(reference) and seen["want_hits"] > 0
        _assert_same(got, reference)
        gained = core.hicache.stats.host_hit_tokens - seen["hits"]
        assert gained == seen["want_hits"], "the fenced pages were not read back from the host"
        assert core.hicache.stats.disk_hit_tokens == 0
        assert core.hicache is hc and core.hicache.host.frames is frames  # outlived the runner


@pytest.mark.timeout(120, method="thread")
def test_host_tier_has_no_drift_over_three_flip_cycles(model_dirs, reference, tmp_path):
    """pp2 ⇄ tp2 three times over, with a disk tier: after every seam the device pool and the
    host tier are exactly accounted (every frame free or mapped, none reserved or pinned, one
    shared buffer), the controller and its frames are the ones of the start, each
    re-admission is read from host memory, the disk tier goes on taking pages, and the shared
    buffer is gone once the engine is."""
    disk = tmp_path / "kv"
    with Engine(str(model_dirs["llama"]), tp_size=2, hicache_dir=str(disk), **PAGED,
                **CFG) as e:
        core = e.core
        hc, frames = core.hicache, core.hicache.host.frames
        hits: list[int] = []

        def seam(when: str) -> None:
            assert core.hicache is hc and hc.host.frames is frames
            hits.append(hc.stats.host_hit_tokens)
            if when == "after":
                hc.io.flush()  # the disk writer pins the frames it reads
                hc.host.check()
                assert hc.host.pinned_pages == 0
                assert len(hc.host) + hc.host.free_frames == hc.host.capacity
                assert hc.in_flight_slots == 0 and not hc.busy
                assert shm_files() == {frames.path.name}

        flips = {1: (1, 2), 3: (2, 1), 5: (1, 2), 7: (2, 1), 9: (1, 2), 11: (2, 1)}
        got, censuses = _drive(e, prompts_for(300), flips, seam)
        hits.append(hc.stats.host_hit_tokens)
        assert [c.retracted > 0 for c in censuses] == [True] * 6
        # after[k] → before[k+1] (and the end): each re-admission loaded pages from the host
        assert all(b > a for a, b in zip(hits[1::2], hits[2::2])), hits
        _assert_same(got, reference)
        hc.flush()
        hc.disk.check()
        assert hc.stats.disk_hit_tokens == 0 and hc.stats.bytes_written > 0
        assert list(disk.rglob("*.page"))
    assert not shm_files()  # the controller freed the host tier at the engine's end


def test_hicache_leaves_a_layout_only_when_nothing_refers_to_it(model_dirs):
    """Crash before corruption: `unbind` (the flip's teardown) raises, changing nothing, while
    a store is in flight or the device tree still holds prefixes; once both are gone the
    controller unbinds and binds again with its host tier intact."""
    import threading

    with Engine(str(model_dirs["llama"]), enable_hicache=True, hicache_page_size=8,
                **CFG) as e:
        core, hc = e.core, e.core.hicache
        gate = threading.Event()
        hc.channel.engine.before_copy = lambda o: gate.wait(30) if o.store_frames else None
        prompt = prompts_for(300)[3]  # 4 full pages
        core.add_request("a", prompt, PARAMS)
        core.step()  # the prefill publishes its prompt: write-through stores its 4 pages
        assert hc.stats.stores_in_flight == 4
        with pytest.raises(RuntimeError, match="in flight"):
            hc.unbind()
        gate.set()
        while core.has_work():
            core.step()
        with pytest.raises(RuntimeError, match="device tree holds"):
            hc.unbind()
        assert hc.kv is core.kv and core.scheduler.hicache is hc  # still bound
        core.kv.tree.evict_all_and_reset()
        pages = len(hc.host)
        hc.unbind()
        with pytest.raises(RuntimeError, match="bound to no layout"):
            hc.unbind()
        hc.bind(core.kv, core.runner.transfer_channel(hc.host.frames, hc.geometry),
                core.runner.dtype)
        assert len(hc.host) == pages >= 4
        e.generate([prompt], PARAMS, use_tqdm=False)
        assert hc.stats.host_hit_tokens == 32  # the 4 pages, from the host tier kept


def test_flip_needs_the_flag_and_a_host_tier(model_dirs):
    from phaseflip.config import EngineConfig

    with pytest.raises(InvalidRequestError, match="--enable-hicache"):
        EngineConfig(model=str(model_dirs["llama"]), enable_flip=True)
    with Engine(str(model_dirs["llama"]), tp_size=2, **CFG) as e:
        with pytest.raises(InvalidRequestError, match="--enable-flip"):
            e.flip(1, 2)


def test_bad_targets_are_refused_before_anything_changes(model_dirs):
    """Refused targets (wrong world size, the same layout, 3 not splitting the heads) leave
    the engine as it was, and the refusal loses none of the output owed (a refused flip once
    made the last step's deltas and dropped them)."""
    prompt = prompts_for(300)[3]
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        (want,) = e.generate([prompt], PARAMS, use_tqdm=False)
    with Engine(str(model_dirs["llama"]), tp_size=2, **FLIP, **CFG) as e:
        e.core.add_request("a", prompt, PARAMS)
        ids = []
        for _ in range(3):
            ids += [t for d in e.core.step() for t in d.token_ids]
        for tp, pp in ((2, 1), (4, 1), (1, 1), (3, 1)):
            with pytest.raises(InvalidRequestError):
                e.flip(tp, pp)
        assert e.core.scheduler.running and (e.core.cfg.tp_size, e.core.cfg.pp_size) == (2, 1)
        while e.core.has_work():
            ids += [t for d in e.core.step() for t in d.token_ids]
    assert ids == want.outputs[0].token_ids


def test_a_seam_that_fails_half_way_stops_the_engine_loudly(model_dirs, monkeypatch):
    with Engine(str(model_dirs["llama"]), tp_size=2, **FLIP, **CFG) as e:
        core = e.core
        core.add_request("a", prompts_for(300)[3], PARAMS)
        core.step()

        def no_memory(*args, **kwargs):
            raise RuntimeError("out of memory (simulated) building the new layout")

        monkeypatch.setattr("phaseflip.engine.core.build_layout_bundle", no_memory)
        with pytest.raises(RuntimeError, match="simulated"):
            core.flip(1, 2)
        for call in (core.step, lambda: core.add_request("b", [1, 2], PARAMS),
                     lambda: core.flip(2, 1)):
            with pytest.raises(RuntimeError, match="phase flip to tp1×pp2 failed after"):
                call()


def test_a_fence_that_stops_the_rank_group_is_not_reported_as_abandoned(model_dirs,
                                                                        monkeypatch):
    """A rank that stalls inside the fence makes the driver stop the whole group (the stall
    watchdog): nothing is left to serve, so the flip must not answer "abandoned, nothing
    changed" (a 400 after which every step fails obscurely) but stop the engine loudly."""
    with Engine(str(model_dirs["llama"]), tp_size=2, **FLIP, **CFG) as e:
        core = e.core
        core.add_request("a", prompts_for(300)[3], PARAMS)
        core.step()

        def stalled_fence():
            core.runner.close(graceful=False)  # what a stall error inside the fence does
            raise RuntimeError("rank 1 stalled (simulated) while fencing")

        monkeypatch.setattr(core.hicache, "fence", stalled_fence)
        with pytest.raises(RuntimeError, match="simulated"):
            core.flip(1, 2)
        with pytest.raises(RuntimeError, match="fence of a phase flip to tp1×pp2 stopped"):
            core.step()


def test_dropping_the_tree_before_retracting_is_refused(model_dirs):
    """Law 6: retract strictly before the tree reset. A reset while requests still lock
    prefixes would orphan them; the drop refuses instead of corrupting the pool."""
    with Engine(str(model_dirs["llama"]), **CFG) as e:
        prompt = prompts_for(300)[-1]
        e.generate([prompt], PARAMS, use_tqdm=False)  # its prefix is now cached
        e.core.add_request("b", prompt, PARAMS)
        e.core.step()  # "b" holds a lock on the cached prefix
        with pytest.raises(RuntimeError, match="protected tokens remain"):
            e.core.kv.tree.evict_all_and_reset()
        while e.core.has_work():
            e.core.step()


@pytest.mark.parametrize("strategy", ["peer", "reload", "resident"])
def test_old_layout_memory_is_freed_even_if_referenced(model_dirs, strategy):
    """A flip frees rank 0's old weights and KV pool in place: on the H200 pair something still
    held the old layout after tp2 → pp2, and the new rank 0 found "-8.10 GiB left for the KV
    cache". Here a reference is held on purpose (the runner and a view of its pool), and the
    old storage must still be gone — the weights too, unless they are resident (parked for the
    next flip back, and then freed with the engine). A pool in the rank's KV arena (every
    strategy but peer) is not freed: the new layout's pool views the same memory."""
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights=strategy, **FLIP,
                **CFG) as e:
        core = e.core
        core.add_request("r0", prompts_for(300)[0], PARAMS)
        core.step()
        old = core.runner.runner  # rank 0's ModelRunner of the tp2 layout
        layer0_k = old.pool.k[0]
        weights = list(old.model.parameters())
        census, _ = core.flip(1, 2)
        if strategy == "peer":
            assert old.pool.kv.untyped_storage().nbytes() == 0
            assert layer0_k.untyped_storage().nbytes() == 0
        else:  # the pool lived in the rank's KV arena, which the new layout's pool now uses
            assert old.pool.kv.numel() == 0 and old.pool.k == []
            new = core.runner.runner.pool
            assert new.kv.untyped_storage().data_ptr() == layer0_k.untyped_storage().data_ptr()
        gone = [p.untyped_storage().nbytes() == 0 for p in weights]
        assert all(gone) if strategy != "resident" else not any(gone)
        assert census.held_after_teardown_bytes is None  # (CPU: not measured)
        while core.has_work():
            core.step()
    assert all(p.untyped_storage().nbytes() == 0 for p in weights)  # the engine's end


def test_requests_the_new_pool_cannot_hold_are_ended(model_dirs, monkeypatch):
    """A flip whose new layout holds fewer KV tokens: a waiting request that no longer fits
    whole is ended ("abort") instead of blocking the queue's head for ever; the others
    finish as usual."""
    import dataclasses

    with Engine(str(model_dirs["llama"]), tp_size=2, **FLIP, **CFG) as e:
        core = e.core
        install = core.install_layout
        monkeypatch.setattr(core, "install_layout", lambda cfg: install(
            dataclasses.replace(cfg, max_total_tokens=64)))
        big = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
        core.add_request("big", prompts_for(300)[0], big)  # fits 4096 tokens, not 64
        core.add_request("small", prompts_for(300)[1][:8], SamplingParams(
            temperature=0.0, max_new_tokens=6, ignore_eos=True))
        core.step()
        census, deltas = core.flip(1, 2)
        ended = [(d.request_id, d.finish_reason) for d in deltas if d.finish_reason]
        assert ended == [("big", "abort")]
        reasons = {}
        for _ in range(50):  # without the check the engine spins here with "big" at the head
            if not core.has_work():
                break
            for d in core.step():
                reasons[d.request_id] = d.finish_reason
        assert reasons.get("small") == "length" and not core.has_work()


def test_a_target_outside_flip_layouts_is_refused_before_the_seam(model_dirs):
    """tp4 with --flip-layouts tp4,pp4: a manual flip to tp2×pp2 must be refused by the checks
    that run before the fence. It used to pass them and fail in the relayout, where the new
    config's own check refused it with the old layout already torn down (the engine gone
    behind a "refused" 400)."""
    from phaseflip.config import EngineConfig
    from phaseflip.flip.seam import check_target
    from phaseflip.model.config import ModelConfig

    cfg = EngineConfig(model=str(model_dirs["llama"]), tp_size=4, enable_flip=True,
                       enable_hicache=True, flip_layouts="tp4,pp4")
    with pytest.raises(InvalidRequestError, match="flips only between tp4×pp1 and tp1×pp4"):
        check_target(cfg, ModelConfig.from_dir(model_dirs["llama"]), 2, 2)


@pytest.mark.parametrize("strategy", ["resident", "peer", "host-image", "reload"])
def test_each_weights_strategy_matches_the_unflipped_run(model_dirs, strategy):
    """tp2 → pp2 → tp2 → pp2 with each weights strategy forced, flips mid-prefill and
    mid-decode, with n = 2 beside n = 1: every output equals the single-process run, and the
    census says how the weights came (resident: nothing moved, nothing loaded)."""
    prompts = prompts_for(300)
    two = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True, logprobs=0, n=2)
    flips = {1: (1, 2), 4: (2, 1), 8: (1, 2)}

    def run(engine: Engine, flips: dict, seam=None) -> tuple[dict, list]:
        core = engine.core
        core.add_request("pair", prompts[0], two)
        outs, censuses = _drive(engine, prompts, flips, seam)
        return outs, censuses

    with Engine(str(model_dirs["llama"]), **CFG) as e:
        want, _ = run(e, {})
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights=strategy, **FLIP,
                **CFG) as e:
        assert e.core.cfg.flip_weights == strategy
        arena = e.core._ranks.rank0.kv_arena  # rank 0's pool: where each layout's lives
        views = [e.core.runner.runner.pool.kv.data_ptr()]

        def seam(when: str) -> None:  # after each flip: rank 0's pool, where it lives
            pool = e.core.runner.runner.pool
            if when == "after":
                views.append(pool.kv.data_ptr() if pool.arena is arena else None)

        got, censuses = run(e, flips, seam)
        ptr = arena.buffer.data_ptr() if arena.nbytes else None
    assert arena.nbytes == 0  # the engine's end frees it
    assert [c.weights for c in censuses] == [strategy] * 3
    if strategy != "peer":  # every layout's pool in the launch layout's KV arena (not peer:
        assert views == [ptr] * 4, views  # its build holds two shards)
        assert {c.kv_slots_after for c in censuses} == {censuses[0].kv_slots_before}
    else:
        assert ptr is None and views[1:] == [None] * 3
    model_cfg = ModelConfig.from_dir(str(model_dirs["llama"]))
    for c, target in zip(censuses, flips.values(), strict=True):
        # every rank's build, rank 0's as the census's own fields say
        assert [r["rank"] for r in c.ranks] == [0, 1]
        assert {r["weights"] for r in c.ranks} == {strategy}
        assert c.ranks[0]["bytes_moved"] == c.weights_bytes_moved
        moved = [r["bytes_moved"] for r in c.ranks]
        if strategy == "resident":
            assert c.weights_bytes_moved == 0 and c.relayout_parts["weights"] < 0.05
            assert moved == [0, 0]
        elif strategy == "peer":  # only the slices each rank lacked, less than its shard
            shards = shard_bytes(model_cfg, *target, torch.float32)
            assert all(0 < m < s for m, s in zip(moved, shards)), (moved, shards)
        else:
            assert all(m > 0 for m in moved)
    assert set(got) == set(want)
    for rid, (ids, lps, reasons) in got.items():
        assert reasons == want[rid][2] and set(reasons) == {"length"}, rid
        assert ids == want[rid][0], rid
        assert lps == pytest.approx(want[rid][1], abs=1e-4), rid


def test_peer_weights_move_fp8_slices_as_they_are(model_dirs):
    """FP8 weights (quantized at load) through three flips: the peer exchange's outputs equal
    a reload's token for token and logprob for logprob (the same FP8 values and row scales)."""
    prompts = prompts_for(300)
    flips = {1: (1, 2), 4: (2, 1), 8: (1, 2)}
    runs = {}
    for strategy in ("reload", "peer"):
        with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights=strategy,
                    quantization="fp8", **FLIP, **CFG) as e:
            runs[strategy], censuses = _drive(e, prompts, flips)
        assert [c.weights for c in censuses] == [strategy] * 3
    assert runs["peer"] == runs["reload"]


@pytest.mark.parametrize("strategy", ["peer", "resident"])
def test_flips_under_kv_pressure_match_the_unflipped_run(model_dirs, strategy):
    """A pool too small for every request at once: the scheduler retracts requests mid-decode
    on its own while flips retract everything at their seams; the outputs still equal the
    single-process run with the same pool."""
    prompts = prompts_for(300) * 2
    small = CFG | {"max_total_tokens": 160}
    with Engine(str(model_dirs["llama"]), **small) as e:
        want, _ = _drive(e, prompts, {})
    flips = {3: (1, 2), 7: (2, 1), 12: (1, 2)}
    with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights=strategy, **FLIP,
                **small) as e:
        got, censuses = _drive(e, prompts, flips)
        pressure = e.core.scheduler.stats.retractions - sum(c.retracted for c in censuses)
    assert pressure > 0, "the pool never ran short: no retraction besides the seams'"
    _assert_same(got, want)
