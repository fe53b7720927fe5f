"""Asynchronous HiCache transfers through the engine: an in-flight load never blocks other
requests, and a pending store's source slots are never reused before its copy has read them.

Tests that hold a copy back do it on the CPU engine, whose copies run on a worker thread (the
CPU stand-in for the copy stream): a held copy is then really pending while the loop runs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from phaseflip import SamplingParams
from phaseflip.cache.hicache import page_keys, payload_tensor
from tests.conftest import prompts_for

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8}


def test_an_in_flight_load_does_not_block_other_requests(llama_dir, make_engine, tmp_path):
    """A's prefix is on disk behind a slow disk (reads wait on a gate); B, submitted after A,
    is admitted and finishes while A's read is still held, then A is served from disk."""
    cfg = HC | {"hicache_dir": str(tmp_path / "kv")}
    vocab = make_engine(llama_dir).model_config.vocab_size
    long_a = prompts_for(vocab)[3]  # 33 tokens: 4 full pages
    short_b = [7, 8, 9]
    first = make_engine(llama_dir, **cfg)
    want_a = first.generate([long_a], GREEDY, use_tqdm=False)[0].token_ids
    want_b = first.generate([short_b], GREEDY, use_tqdm=False)[0].token_ids
    first.core.hicache.flush()

    engine = make_engine(llama_dir, **cfg)  # a restart: A's pages are only on disk
    hc = engine.core.hicache
    gate, reads = threading.Event(), []
    real_read = hc.disk.read_into

    def slow_read(key, out):
        reads.append(key)
        assert gate.wait(30), "the test never opened the gate"
        return real_read(key, out)

    hc.disk.read_into = slow_read
    core = engine.core
    core.add_request("a", long_a, GREEDY)
    core.add_request("b", short_b, GREEDY)
    req_a, req_b = core.groups["a"].reqs[0], core.groups["b"].reqs[0]
    outputs: dict[str, list[int]] = {"a": [], "b": []}
    b_done_while_a_loading = None
    for _ in range(200):
        for d in core.step():
            outputs[d.request_id] += d.token_ids
        if req_b.finished and b_done_while_a_loading is None:
            b_done_while_a_loading = not gate.is_set() and not req_a.output_ids
            gate.set()
        if req_a.finished and req_b.finished and not core.has_work():
            break
    for d in core.step():  # text of the last step
        outputs[d.request_id] += d.token_ids
    assert reads, "A's pages were not read from disk"
    assert b_done_while_a_loading, "B waited for A's disk read"
    assert outputs == {"a": want_a, "b": want_b}
    assert hc.stats.disk_hit_tokens == 32


SHORT = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)


def _reference_pages(llama_dir, make_engine, prompts, fingerprint):
    """key -> expected [L, 2, H, P, D] payload of every full page of every sequence (prompt and
    generated tokens), computed by an engine without HiCache."""
    ref = make_engine(llama_dir, device="cpu", max_total_tokens=4096)
    outs = ref.generate(prompts, SHORT, use_tqdm=False)
    tree, pool = ref.core.kv.tree, ref.core.runner.pool
    expected = {}
    for prompt, out in zip(prompts, outs):
        seq = prompt + out.token_ids[:-1]  # the last token never had its KV computed
        n = len(seq) // 8 * 8
        slots = tree.match_prefix(seq[:n]).slots
        assert slots.numel() == n
        for i, key in enumerate(page_keys(seq[:n], 8, fingerprint)):
            page = slots[i * 8 : (i + 1) * 8]
            expected[key] = torch.stack([torch.stack((k[page], v[page])) for k, v in
                                         zip(pool.k, pool.v)]).transpose(2, 3)
    return [o.token_ids for o in outs], expected


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_pending_store_keeps_its_source_slots(policy, llama_dir, make_engine):
    """A pool that fits one request at a time and copies that take 0.5 s (each request runs
    in a few steps): the next request needs the slots a pending copy still reads. Every stored
    page must hold exactly the KV of its tokens (reusing the slots early would store another
    request's KV under its key)."""
    vocab = make_engine(llama_dir).model_config.vocab_size
    prompts = [p[:24] + [i + 1] * 9 for i, p in enumerate(
        [prompts_for(vocab, seed=s, shared=False)[3] for s in range(4)])]
    engine = make_engine(llama_dir, device="cpu", max_total_tokens=48,
                         hicache_write_policy=policy, **HC)
    hc = engine.core.hicache
    hc.channel.engine.before_copy = lambda orders: time.sleep(0.5) if orders.store_frames else None
    got = [o.token_ids for o in engine.generate(prompts, SHORT, use_tqdm=False)]
    want, expected = _reference_pages(llama_dir, make_engine, prompts, hc.fingerprint)
    assert got == want
    hc.flush()
    keys = hc.host.keys()
    assert len(keys) >= 8 and hc.stats.sync_writebacks < hc.stats.pages_written
    for key in keys:
        frame = payload_tensor(hc.host.frame(hc.host.frame_of(key)), hc.geometry)
        assert torch.allclose(frame, expected[key], atol=1e-5), "a page holds foreign KV"


def test_in_flight_load_slots_are_accounted(llama_dir, make_engine):
    """While a load's host->device copy is held, its slots are neither free, nor in the tree,
    nor a request's: `HiCache.in_flight_slots` names them and closes the pool balance. Another
    request runs meanwhile; once the copy lands the pages join the tree and the balance is the
    usual four-term one again."""
    engine = make_engine(llama_dir, device="cpu", **HC)  # copies on the CPU copy thread
    core, hc = engine.core, engine.core.hicache
    prompt = prompts_for(engine.model_config.vocab_size)[3]  # 4 full pages
    want = engine.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    core.kv.tree.evict_all_and_reset()
    gate = threading.Event()
    hc.channel.engine.before_copy = lambda o: gate.wait(30) if o.load_frames else None
    core.add_request("a", prompt, GREEDY)
    core.add_request("b", [5, 6, 7], GREEDY)
    core.step()
    acc = core.kv.accounting(core.scheduler.running)
    assert hc.in_flight_slots == 32 and [r.rid for r in core.scheduler.running] == ["b#0"]
    assert acc.total == acc.free + acc.evictable + acc.locked + hc.in_flight_slots
    assert not acc.balanced  # the four classes alone miss the in-flight slots
    gate.set()
    req_a = core.groups["a"].reqs[0]
    while core.has_work():
        core.step()
    assert req_a.output_ids == want and hc.in_flight_slots == 0
    assert hc.stats.host_hit_tokens == 32
    assert core.kv.check(core.scheduler.running).balanced


def test_full_disk_queue_drops_writes_instead_of_blocking(tmp_path):
    """A disk that stalls: writes beyond the queue bound are dropped and counted at once; the
    queued ones land when the disk resumes, their host frames pinned until then."""
    from phaseflip.cache.hicache import DiskPageStore, HostPagePool
    from phaseflip.cache.hicache.disk_io import DiskIO
    from phaseflip.cache.hicache.frames import page_geometry

    geo = page_geometry(2, 2, 4, torch.float32, 8)
    host = HostPagePool(8, geo.total_size, fingerprint=b"f" * 16)
    disk = DiskPageStore(tmp_path / "kv", b"f" * 16, 1 << 20)
    io = DiskIO(disk, host, geo, queue_pages=2)
    gate = threading.Event()
    real_put = disk.put_payload
    disk.put_payload = lambda *a: gate.wait(30) and real_put(*a)
    keys = page_keys(list(range(5 * 8)), 8, b"f" * 16)
    for i, key in enumerate(keys):
        host.put(key, (torch.full((2, 2, 8, 4), float(i)), torch.zeros((2, 2, 8, 4))))
    start = time.monotonic()
    accepted = [io.write(key) for key in keys]
    assert time.monotonic() - start < 1.0  # never waited for the stalled disk
    assert accepted == [True, True, False, False, False] and io.writes_dropped == 3
    assert [host.pin_count(k) for k in keys] == [1, 1, 0, 0, 0]
    gate.set()
    io.flush()
    assert [disk.contains(k) for k in keys] == [True, True, False, False, False]
    assert all(host.pin_count(k) == 0 for k in keys)
    io.close()


def test_load_of_an_aborted_request_leaves_no_lock_at_idle(llama_dir, make_engine):
    """A request aborted while its pages are being copied; then the last request leaves. The
    copy lands during the idle quiesce — its pages must become ordinary cached prefixes, not
    stay locked with no step left to unlock them (a cache flush then failed and took the
    server's engine process down)."""
    engine = make_engine(llama_dir, device="cpu", **HC)
    core, hc = engine.core, engine.core.hicache
    prompt = prompts_for(engine.model_config.vocab_size)[3]  # 4 full pages
    engine.generate([prompt], GREEDY, use_tqdm=False)
    core.kv.tree.evict_all_and_reset()  # the prefix lives only in the host tier now
    gate = threading.Event()
    hc.channel.engine.before_copy = lambda o: gate.wait(30) if o.load_frames else None
    long = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    core.add_request("c", [3, 4, 5, 6], long)
    core.step()
    core.add_request("b", prompt + [7, 8, 9], GREEDY)
    core.step()  # b's pages are being copied (held by the gate)
    assert hc.stats.loads_in_flight > 0
    threading.Timer(0.2, gate.set).start()
    core.abort("b")
    core.abort("c")  # the last request leaves: quiesce lands the copy
    assert not core.has_work()
    assert core.kv.tree.protected_size() == 0
    assert core.kv.tree.evict_all_and_reset() > 0  # what /flush_cache does when idle
