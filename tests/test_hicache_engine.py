"""HiCache through the engine: same outputs, prefixes served from host and disk tiers instead
of being recomputed, corruption is a miss, capacities hold."""

from __future__ import annotations

import logging

import pytest

from phaseflip import SamplingParams
from tests.conftest import prompts_for

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8}


def long_prompts(vocab: int) -> list[list[int]]:
    return [p for p in prompts_for(vocab) if len(p) >= 17]


def flush(engine) -> None:
    engine.core.kv.tree.evict_all_and_reset()


def computed_tokens(engine) -> int:
    """Tokens fed through the model so far (prefill and decode)."""
    st = engine.core.scheduler.stats
    return st.prefill_tokens + st.decode_tokens


@pytest.mark.parametrize("page_size", [1, 8])
def test_outputs_identical_with_hicache(page_size, llama_dir, make_engine):
    plain = make_engine(llama_dir, page_size=page_size)
    prompts = long_prompts(plain.model_config.vocab_size)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    engine = make_engine(llama_dir, page_size=page_size, **HC)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    flush(engine)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert engine.core.hicache.stats.host_hit_tokens > 0


def test_flushed_prefix_is_read_from_host_not_recomputed(llama_dir, make_engine):
    engine = make_engine(llama_dir, **HC)
    prompt = prompts_for(engine.model_config.vocab_size)[3]
    assert len(prompt) == 33  # 4 full pages and one token
    first = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    flush(engine)
    before = computed_tokens(engine)
    again = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.token_ids == first.token_ids
    stats = engine.core.hicache.stats
    assert stats.host_hit_tokens == 32  # the 4 full pages of the prompt
    # only the uncached tail of the prompt is computed, then the decode steps
    assert computed_tokens(engine) - before == (len(prompt) - 32) + (GREEDY.max_new_tokens - 1)
    assert again.usage.cached_tokens == 32
    # copy rates are measured once copies happened (None before: unmeasured is not zero)
    assert stats.store_gbps is not None and stats.store_gbps > 0
    assert stats.load_gbps is not None and stats.load_gbps > 0


def test_write_back_stores_pages_when_the_device_evicts_them(llama_dir, make_engine):
    engine = make_engine(llama_dir, hicache_write_policy="write_back", **HC)
    prompts = long_prompts(engine.model_config.vocab_size)
    want = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    hc = engine.core.hicache
    assert hc.stats.pages_written == 0  # nothing evicted yet, nothing written
    flush(engine)  # evicts everything: write-back now
    assert hc.stats.pages_written > 0
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert hc.stats.host_hit_tokens > 0


def test_fence_persists_every_cached_prefix(llama_dir, make_engine):
    """The flip's fence under write-back: dirty pages are stored at once, so the device tree can
    then be dropped without a single synchronous write-back, and the prompts come back from
    the host tier."""
    engine = make_engine(llama_dir, hicache_write_policy="write_back", **HC)
    prompts = long_prompts(engine.model_config.vocab_size)
    want = [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]
    hc = engine.core.hicache
    assert hc.stats.pages_written == 0
    hc.fence()
    written = hc.stats.pages_written
    assert written > 0 and hc.stats.stores_in_flight == 0
    flush(engine)
    assert hc.stats.sync_writebacks == 0 and hc.stats.pages_written == written
    assert [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert hc.stats.host_hit_tokens > 0


def test_restart_reads_the_disk_tier(llama_dir, make_engine, tmp_path):
    cfg = HC | {"hicache_dir": str(tmp_path / "kv")}
    first = make_engine(llama_dir, **cfg)
    prompts = long_prompts(first.model_config.vocab_size)
    want = [o.token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)]
    first.core.hicache.flush()  # disk writes run on a thread; a shutdown waits for them too
    assert first.core.hicache.stats.bytes_written > 0
    second = make_engine(llama_dir, **cfg)  # a new process would see the same directory
    got = [o.token_ids for o in second.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    assert second.core.hicache.stats.disk_hit_tokens > 0


def test_corrupt_disk_page_is_a_miss_with_a_warning(llama_dir, make_engine, tmp_path, caplog):
    cfg = HC | {"hicache_dir": str(tmp_path / "kv")}
    first = make_engine(llama_dir, **cfg)
    prompt = long_prompts(first.model_config.vocab_size)[0]
    want = first.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    first.core.hicache.flush()
    pages = sorted((tmp_path / "kv").rglob("*.page"))
    assert pages
    for f in pages:  # flip a byte in the middle of every payload
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    second = make_engine(llama_dir, **cfg)
    with caplog.at_level(logging.WARNING, logger="phaseflip.hicache"):
        got = second.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    assert got == want
    assert second.core.hicache.stats.disk_hit_tokens == 0
    assert any("corrupt" in r.message.lower() or "checksum" in r.message.lower()
               for r in caplog.records)


def test_capacities_hold_under_a_larger_workload(llama_dir, make_engine, tmp_path):
    page_bytes = 2 * 2 * 2 * 8 * 16 * 4  # k+v, 2 layers, 2 kv heads, 8 tokens, dim 16, fp32
    cfg = HC | {"hicache_dir": str(tmp_path / "kv"), "hicache_host_gb": 6 * page_bytes / 2**30,
                "hicache_disk_gb": 10 * (page_bytes + 512) / 2**30}
    engine = make_engine(llama_dir, **cfg)
    prompts = [list(range(1 + i, 41 + i)) for i in range(0, 60, 7)]  # ~45 distinct pages
    engine.generate(prompts, GREEDY, use_tqdm=False)
    hc = engine.core.hicache
    hc.flush()
    hc.host.check()
    hc.disk.check()
    assert len(hc.host) <= hc.host.capacity
    assert hc.disk.used_bytes <= 10 * (page_bytes + 512)
    assert hc.host.stats.evictions > 0 and hc.stats.pages_written > 6


def test_hicache_needs_the_prefix_cache(llama_dir):
    from phaseflip import Engine, InvalidRequestError

    with pytest.raises(InvalidRequestError, match="needs the prefix cache"):
        Engine(str(llama_dir), device="cpu", enable_prefix_cache=False, **HC)


def test_hicache_counters_reach_metrics_and_server_info(tmp_path):
    import httpx

    from tests.server_process import start_server, stop_server

    proc, url = start_server("--enable-hicache", "--hicache-page-size", "8")
    try:
        body = {"model": "tiny-llama", "prompt": "Return the value of the attribute " * 3,
                "max_tokens": 2}
        httpx.post(url + "/v1/completions", json=body, timeout=30).raise_for_status()
        httpx.post(url + "/flush_cache", timeout=30).raise_for_status()
        httpx.post(url + "/v1/completions", json=body, timeout=30).raise_for_status()
        info = httpx.get(url + "/server_info").json()["hicache"]
        assert info["pages_written"] > 0 and info["host_hit_tokens"] > 0
        metrics = httpx.get(url + "/metrics").text
        assert 'phaseflip_hicache_hit_tokens_total{model_name="tiny-llama",tier="host"}' in metrics
        assert 'hicache_transfer_gbps{direction="load",model_name="tiny-llama"}' in metrics
        assert info["load_gbps"] > 0
    finally:
        stop_server(proc)
