"""HiCache accounting (issue: HiCache audit): the totals reach /metrics as counters that never go
down, a disk read that fails is never counted as a disk hit, a burst of requests whose disk
pages outnumber the host frames reads each page once and uses it, and a phase flip with a host
and a disk tier (disk faults included) keeps the greedy tokens of an engine without HiCache.

Disk faults are injected as EIO from the page file's read (a bad sector), under the store's own
error handling, as test_hicache_disk_faults.py does for its faults.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from phaseflip import Engine, SamplingParams
from phaseflip.cache.hicache import (
    DiskPageStore,
    HostPagePool,
    encode_page,
    model_fingerprint,
    page_keys,
)
from phaseflip.cache.hicache.disk_io import DiskIO
from phaseflip.cache.hicache.disk_store import _FileReader
from phaseflip.cache.hicache.frames import frame_stride, page_geometry
from phaseflip.server.metrics import ServerMetrics
from tests.conftest import prompts_for
from tests.test_flip import CFG, PAGED, _assert_same, _drive
from tests.test_metrics_accounting import HICACHE_STATS, one

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8}
PROMPT_PAGES = 4  # 33-token prompts: 4 full pages and a token


def fail_reads(monkeypatch, fail: Callable[[bytes], bool],
               before: Callable[[bytes], None] | None = None) -> list[bytes]:
    """Reads of the disk tier's page files whose key `fail` picks end in EIO (`before(key)`
    runs first); returns the keys whose reads failed, in order."""
    real, failed, lock = _FileReader.readinto, [], threading.Lock()

    def readinto(self, off: int, buf: memoryview) -> int:
        key = bytes.fromhex(Path(os.readlink(f"/proc/self/fd/{self.fd}")).stem)
        with lock:
            if not fail(key):
                return real(self, off, buf)
            failed.append(key)
        if before is not None:
            before(key)
        raise OSError(errno.EIO, "Input/output error (injected)")

    monkeypatch.setattr(_FileReader, "readinto", readinto)
    return failed


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (n, PROMPT_PAGES * 8 + 1), generator=g).tolist()


def on_disk(make_engine, llama_dir, kv: Path, batch: list[list[int]]) -> tuple[list, float]:
    """Computes `batch` once with a disk tier at `kv` (every page written): its outputs, and
    the bytes of one host frame."""
    writer = make_engine(llama_dir, hicache_dir=str(kv), **HC)
    want = [o.token_ids for o in writer.generate(batch, GREEDY, use_tqdm=False)]
    hc = writer.core.hicache
    hc.flush()
    assert len(hc.disk) == PROMPT_PAGES * len(batch)
    return want, frame_stride(hc.geometry.total_size)


@pytest.fixture(scope="module")
def reference(llama_dir) -> dict:
    """test_flip's flip-free run of prompts_for(300): one process, no HiCache."""
    with Engine(str(llama_dir), **CFG) as e:
        return _drive(e, prompts_for(300), {})[0]


# ---------------------------------------------------------------- /metrics


def test_hicache_totals_are_counters_that_never_go_down():
    """`rate()` needs counters: the totals are `_total` counters from the first scrape (typed,
    no samples until the engine reports), following the engine's deltas; a total that drops
    (an engine counting from 0 again) adds its new count instead of going down. The copy
    rate stays a gauge."""
    m = ServerMetrics("tiny")
    families = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for name in ("hicache_hit_tokens", "hicache_bytes", "hicache_pages", "num_preemptions"):
        assert families[f"phaseflip_{name}"].type == "counter", name
        assert not families[f"phaseflip_{name}"].samples, name
    seen = []
    for host_hits, retractions in ((64, 7), (100, 9), (30, 2), (50, 2)):
        m.observe_engine({"running": 0, "waiting": 0, "scheduler": {"retractions": retractions},
                          "pool": {"total": 1, "protected": 0, "private": 0},
                          "hicache": HICACHE_STATS | {"host_hit_tokens": host_hits,
                                                      "load_gbps": host_hits / 10}})
        text = m.render().decode()
        seen.append((one(text, "phaseflip_hicache_hit_tokens_total", tier="host"),
                     one(text, "phaseflip_num_preemptions_total"),
                     one(text, "phaseflip_hicache_pages_total", event="written"),
                     one(text, "phaseflip_hicache_transfer_gbps", direction="load")))
    assert seen == [(64, 7, 5, 6.4), (100, 9, 5, 10.0), (130, 11, 5, 3.0), (150, 11, 5, 5.0)]
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["phaseflip_hicache_transfer_gbps"] == "gauge"


# ---------------------------------------------------------------- disk hits are exact


@pytest.mark.parametrize("stored_meanwhile", [False, True])
def test_a_failed_disk_read_is_never_a_disk_hit(stored_meanwhile, llama_dir, make_engine,
                                                 tmp_path, monkeypatch):
    """The read of a prompt's second page fails. Alone, the load stops there (1 page from
    disk). When the same page reaches the host tier meanwhile (another writer stores it while
    the read fails), it is loaded from there: a host hit. It was counted as read from disk
    (4 disk pages, 0 host) because the load remembered that a promotion had started, not
    whether it landed."""
    batch = prompts(1)
    want, _ = on_disk(make_engine, llama_dir, tmp_path / "kv", batch)
    engine = make_engine(llama_dir, hicache_dir=str(tmp_path / "kv"), **HC)
    hc = engine.core.hicache
    keys = hc._keys(batch[0])

    def store(key: bytes) -> None:
        if stored_meanwhile:
            assert hc.host.put(key, hc.disk.path(key).read_bytes())

    failed = fail_reads(monkeypatch, lambda k: k == keys[1], store)
    assert [o.token_ids for o in engine.generate(batch, GREEDY, use_tqdm=False)] == want
    s = hc.stats
    assert failed == [keys[1]] and s.disk_read_errors == 1
    host_pages = 1 if stored_meanwhile else 0
    disk_pages = 3 if stored_meanwhile else 1
    assert (s.host_hit_tokens, s.disk_hit_tokens) == (8 * host_pages, 8 * disk_pages)
    hc.flush()  # the page whose read failed is written again: pinned until its write is done
    assert hc.host.pinned_pages == 0
    hc.host.check()


# ---------------------------------------------------------------- bursts


def test_a_promoted_page_stays_pinned_until_its_reader_lets_go(tmp_path):
    """Two pages promoted into a 2-frame host tier: a third reservation (a later promotion or
    a store) finds no frame instead of evicting a page read for a load that has not taken it
    yet; once the reader unpins, the page is an ordinary LRU page again."""
    fp = model_fingerprint({"num_hidden_layers": 2}, "float32")
    geo = page_geometry(2, 2, 4, torch.float32, 8)
    keys = page_keys(list(range(3 * 8)), 8, fp)
    host = HostPagePool(2, geo.total_size, fingerprint=fp)
    disk = DiskPageStore(tmp_path, fp, 1 << 20, geometry=geo)
    io = DiskIO(disk, host, geo, queue_pages=4)
    try:
        for i, key in enumerate(keys[:2]):
            k, v = (torch.full((2, 2, 8, 4), float(i + j)) for j in range(2))
            assert disk.put(key, encode_page(k, v, fp))
            fut = io.promote(key)
            assert fut is not None and fut.result(timeout=30) is True
            assert host.pin_count(key) == 1
        assert host.reserve() is None and io.promote(keys[2]) is None
        host.unpin(keys[0])
        frame = host.reserve()
        assert frame is not None and not host.contains(keys[0]) and host.contains(keys[1])
        host.abandon(frame)
        host.unpin(keys[1])
        host.check()
    finally:
        io.close()


@pytest.mark.parametrize("frames", [8, 2])
def test_a_burst_larger_than_the_host_tier_reads_each_page_once(frames, llama_dir,
                                                                make_engine, tmp_path):
    """4 requests whose 16 pages are on disk only, at once, with 8 (or 2: less than one
    request's pages) host frames. Promoted pages were evicted by later promotions or stores
    before their load took them (8 frames: 8 pages read, none used, every prompt computed
    again). Each page is read once and loaded now, as host frames free up."""
    batch = prompts(4)
    want, frame_bytes = on_disk(make_engine, llama_dir, tmp_path / "kv", batch)
    engine = make_engine(llama_dir, hicache_dir=str(tmp_path / "kv"),
                         hicache_host_gb=frames * frame_bytes / 2**30, **HC)
    hc = engine.core.hicache
    assert hc.host.capacity == frames
    assert [o.token_ids for o in engine.generate(batch, GREEDY, use_tqdm=False)] == want
    s = hc.stats
    assert s.disk_hit_tokens == 8 * hc.disk.stats.hits, "pages read from disk and not used"
    if frames == 8:
        assert s.disk_hit_tokens == 8 * PROMPT_PAGES * len(batch) and s.miss_pages == 0
    hc.flush()  # (queued disk writes hold their frames)
    assert hc.host.pinned_pages == 0
    hc.host.check()


@pytest.mark.timeout(60, method="thread")  # (unbounded, the engine ends up quiescing on the
# in-flight future below, for ever: a failure at the deadline)
def test_a_request_waits_for_a_host_frame_a_bounded_number_of_tries(llama_dir, make_engine,
                                                                     tmp_path):
    """A request whose pages are on disk and finds every host frame held waits while HiCache
    is busy: write-back's cleaner can hold every frame again each step, so without a bound it
    waited as long as others kept arriving (39 steps in a review's stress run). Here the
    frames stay held and HiCache busy throughout: after FRAME_WAITS tries it computes."""
    from concurrent.futures import Future

    from phaseflip.scheduler.hicache import FRAME_WAITS

    batch = prompts(1)
    want, frame_bytes = on_disk(make_engine, llama_dir, tmp_path / "kv", batch)
    engine = make_engine(llama_dir, hicache_dir=str(tmp_path / "kv"),
                         hicache_host_gb=2 * frame_bytes / 2**30, **HC)
    hc, core = engine.core.hicache, engine.core
    # a request that keeps the engine stepping (an idle engine quiesces HiCache, which would
    # wait on the future below), every frame held (by a store) and something in flight
    core.add_request("long", prompts(1, seed=1)[0][:5],
                     SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True))
    core.step()
    held = [hc.host.reserve() for _ in range(hc.host.capacity)]
    hc._promoting[b"elsewhere"] = Future()
    core.add_request("r", batch[0], GREEDY)
    steps = 0
    while core.scheduler.waiting:
        core.step()
        steps += 1
        assert steps <= FRAME_WAITS + 2, "the request waited past its bound"
    assert steps > FRAME_WAITS // 2, "it did not wait for a frame at all"
    del hc._promoting[b"elsewhere"]
    for frame in held:
        hc.host.abandon(frame)
    out = []
    while core.has_work():
        out += [d for d in core.step() if d.request_id == "r"]
    assert [t for d in out for t in d.token_ids] == want[0]
    hc.flush()  # (queued disk writes hold their frames)
    assert hc.stats.disk_hit_tokens == 0 and hc.host.pinned_pages == 0


# ---------------------------------------------------------------- flips


@pytest.mark.timeout(60, method="thread")  # signals cannot interrupt gloo
def test_flips_with_host_and_disk_tiers_and_disk_faults(llama_dir, make_engine, reference,
                                                        tmp_path, monkeypatch):
    """tp2 → pp2 → tp2 with a 6-frame host tier over a disk tier that holds every prompt's
    pages, every other disk read failing: the first steps promote from disk, the flip's fence
    meets those reads in flight, re-admissions after it read the disk again (and fail again).
    Every output equals the run without HiCache; failed reads are misses, nothing is left
    pinned and the tiers' accounting holds."""
    kv = tmp_path / "kv"
    writer = make_engine(llama_dir, hicache_dir=str(kv), max_total_tokens=4096, **HC)
    _assert_same(_drive(writer, prompts_for(300), {})[0], reference)
    writer.core.hicache.flush()
    frames = 6 * frame_stride(writer.core.hicache.geometry.total_size) / 2**30
    reads = []
    failed = fail_reads(monkeypatch, lambda k: reads.append(k) or len(reads) % 2 == 0)
    with Engine(str(llama_dir), tp_size=2, hicache_dir=str(kv),
                **(PAGED | {"hicache_host_gb": frames}), **CFG) as e:
        hc = e.core.hicache
        assert hc.host.capacity == 6
        in_flight = []

        def seam(when: str) -> None:
            if when == "before":
                in_flight.append(hc.stats.loads_in_flight)

        got, censuses = _drive(e, prompts_for(300), {1: (1, 2), 3: (2, 1)}, seam)
        _assert_same(got, reference)
        assert [c.target for c in censuses] == ["tp1×pp2", "tp2×pp1"]
        assert in_flight[0] > 0, "no disk page was on its way when the first seam began"
        s = hc.stats
        assert failed and s.disk_read_errors == len(failed) and s.disk_hit_tokens > 0
        hc.flush()
        assert hc.host.pinned_pages == 0 and not hc.busy
        hc.host.check()
        hc.disk.check()
