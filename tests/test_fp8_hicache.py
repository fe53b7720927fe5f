"""HiCache with an FP8 KV cache: pages record their dtype, and a page of one KV dtype is never
read as another (the page header, the model fingerprint, and the transfer engine each refuse)."""

from __future__ import annotations

import pytest
import torch

from phaseflip import Engine, SamplingParams
from phaseflip.cache.hicache.frames import HostFrames, page_geometry
from phaseflip.cache.hicache.page import (
    ForeignPageError,
    decode_page,
    encode_page,
    model_fingerprint,
    parse_header,
)
from phaseflip.cache.hicache.transfer import KVTransferEngine, RankSlice
from phaseflip.cache.kv_pool import KVPool
from tests.conftest import prompts_for

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8}


def test_fp8_page_records_its_dtype_and_round_trips():
    k = torch.randn(2, 3, 8, 16).to(FP8)  # [layers, heads, tokens, dim]
    v = torch.randn(2, 3, 8, 16).to(FP8)
    fp = model_fingerprint({"hidden_size": 48}, FP8)
    page = encode_page(k, v, fp)
    header = parse_header(page, fp)
    assert header.dtype == FP8 and header.block_bytes == 8 * 16  # one byte per element
    k2, v2 = decode_page(page, fp)
    assert k2.dtype == FP8 and torch.equal(k2.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(v2.view(torch.uint8), v.view(torch.uint8))


def test_a_page_of_another_kv_dtype_is_foreign():
    """Same model, other KV dtype: another fingerprint, so a store answers a miss."""
    cfg = {"hidden_size": 48}
    fp8_fp, bf16_fp = model_fingerprint(cfg, FP8), model_fingerprint(cfg, torch.bfloat16)
    assert fp8_fp != bf16_fp
    page = encode_page(torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16),
                       torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16), bf16_fp)
    with pytest.raises(ForeignPageError):
        parse_header(page, fp8_fp)


def test_transfer_engine_refuses_a_pool_of_another_dtype():
    """The device side: an FP8 pool bound to bf16 pages (or back) would copy bytes of one
    format into the other; refused when the transfer engine is made."""
    geo_bf16 = page_geometry(2, 2, 16, torch.bfloat16, 8)
    frames = HostFrames.private(4, geo_bf16.total_size)
    part = RankSlice(range(2), range(2))
    pool = KVPool(64, (0, 2), 2, 16, FP8, "cpu")
    with pytest.raises(ValueError, match="never read as another dtype"):
        KVTransferEngine(pool, frames, geo_bf16, part, torch.device("cpu"))
    geo_fp8 = page_geometry(2, 2, 16, FP8, 8)
    assert geo_fp8.total_size < geo_bf16.total_size
    KVTransferEngine(pool, HostFrames.private(4, geo_fp8.total_size), geo_fp8, part,
                     torch.device("cpu"))


def test_engine_fp8_kv_pages_through_host_and_disk(llama_dir, make_engine, tmp_path):
    """An FP8-KV engine stores and reuses FP8 pages (host tier, then disk after a restart),
    with the outputs of the same engine without HiCache; the disk pages a float-KV engine
    wrote in the same directory are foreign to it (no hit), never read as FP8."""
    disk = {"hicache_dir": str(tmp_path / "kv")}
    fp8 = {"kv_cache_dtype": "fp8_e4m3"}
    plain = make_engine(llama_dir, **fp8)
    prompts = [p for p in prompts_for(plain.model_config.vocab_size) if len(p) >= 17]
    want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]

    float_kv = make_engine(llama_dir, **HC, **disk)
    float_kv.generate(prompts, GREEDY, use_tqdm=False)
    float_kv.core.hicache.flush()
    assert float_kv.core.hicache.stats.bytes_written > 0

    first = make_engine(llama_dir, **HC, **disk, **fp8)
    assert first.core.hicache.geometry.dtype == FP8
    got = [o.token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and first.core.hicache.stats.disk_hit_tokens == 0
    first.core.kv.tree.evict_all_and_reset()  # now only the host tier holds the prefixes
    again = [o.token_ids for o in first.generate(prompts, GREEDY, use_tqdm=False)]
    assert again == want and first.core.hicache.stats.host_hit_tokens > 0
    first.core.hicache.flush()

    second = make_engine(llama_dir, **HC, **disk, **fp8)  # a restart: the disk tier
    got = [o.token_ids for o in second.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want and second.core.hicache.stats.disk_hit_tokens > 0


@pytest.mark.timeout(240, method="thread")  # gloo ranks: signals cannot interrupt them
def test_flips_with_fp8_weights_and_kv(model_dirs):
    """tp2 -> pp2 -> tp2 mid-generation with FP8 weights and FP8 KV: the host tier carries FP8
    pages from one layout's ranks (their heads) to the other's (their layers), every request
    finishes once, and the greedy tokens are the unflipped tp2 run's."""
    from tests.test_flip import CFG, PAGED, _drive

    fp8 = {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"}
    prompts = prompts_for(300)
    with Engine(str(model_dirs["llama"]), tp_size=2, **PAGED, **CFG, **fp8) as e:
        want, _ = _drive(e, prompts, {})
    with Engine(str(model_dirs["llama"]), tp_size=2, **PAGED, **CFG, **fp8) as e:
        got, censuses = _drive(e, prompts, {3: (1, 2), 7: (2, 1)})
        assert e.core.hicache.geometry.dtype == FP8
        assert e.core.hicache.stats.host_hit_tokens > 0  # re-admissions read FP8 pages
    assert len(censuses) == 2 and censuses[0].retracted > 0
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert all(v[2] == ["length"] for v in got.values())
