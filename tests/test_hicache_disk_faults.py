"""The HiCache disk tier under faults: a bad, foreign or unreachable page is a miss (the prefix
is computed again, greedy output unchanged), never a crash and never another engine's KV; a
failure is counted and logged a few times, not once per page; a deleted directory comes back;
a second engine on the directory is told what sharing it costs."""

from __future__ import annotations

import errno
import logging
import shutil
from pathlib import Path

import pytest
import torch

from phaseflip import SamplingParams
from phaseflip.cache.hicache import (
    DiskPageStore,
    HostPagePool,
    encode_page,
    model_fingerprint,
    page_keys,
)
from phaseflip.cache.hicache.disk_io import DiskIO
from phaseflip.cache.hicache.frames import page_geometry
from tests.conftest import prompts_for

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
HC = {"enable_hicache": True, "hicache_page_size": 8}
L, H, D, P = 2, 2, 4, 8
FP = model_fingerprint({"num_hidden_layers": L, "num_key_value_heads": H}, "float32")
KEYS = page_keys(list(range(8 * P)), P, FP)


def page(seed: int, tokens: int = P) -> bytes:
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn((L, H, tokens, D), generator=g) for _ in range(2))
    return encode_page(k, v, FP)


PAGE_BYTES = len(page(0))


def long_prompts(vocab: int) -> list[list[int]]:
    return [p for p in prompts_for(vocab) if len(p) >= 17]


def outputs(engine, prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, GREEDY, use_tqdm=False)]


def hicache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "phaseflip.hicache" and r.levelno >= logging.WARNING]


@pytest.fixture
def undeletable_pages(monkeypatch):
    """A read-only directory for a root user too: unlinking a page file fails with EACCES."""
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self.suffix == ".page":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_unlink(self, missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)


# ---------------------------------------------------------------- through the engine


def test_pages_of_float_weights_are_never_read_by_an_fp8_weights_engine(
        llama_dir, make_engine, tmp_path):
    """`--quantization fp8` of a float checkpoint makes other KV from the same config, files
    and KV dtype: its engine must not take the float engine's pages for its own."""
    cfg = HC | {"hicache_dir": str(tmp_path / "kv")}
    writer = make_engine(llama_dir, **cfg)
    prompts = long_prompts(writer.model_config.vocab_size)
    outputs(writer, prompts)
    writer.core.hicache.flush()
    assert writer.core.hicache.stats.bytes_written > 0
    want = outputs(make_engine(llama_dir, quantization="fp8"), prompts)
    reader = make_engine(llama_dir, quantization="fp8", **cfg)
    assert outputs(reader, prompts) == want
    assert reader.core.hicache.stats.disk_hit_tokens == 0


def test_failed_disk_writes_are_counted_and_logged_a_few_times(llama_dir, make_engine,
                                                               tmp_path, caplog):
    """Every page's fan-out directory is a file, so every write fails (as on a full or
    read-only disk): outputs are those without HiCache, every failure is counted in the
    engine's stats, and the log says it twice (the 1st and the 10th), not once per page."""
    plain = make_engine(llama_dir)
    prompts = long_prompts(plain.model_config.vocab_size)
    want = outputs(plain, prompts)
    kv = tmp_path / "kv"
    kv.mkdir()
    for i in range(256):
        (kv / f"{i:02x}").write_bytes(b"")
    engine = make_engine(llama_dir, hicache_dir=str(kv), **HC)
    with caplog.at_level(logging.WARNING, logger="phaseflip.hicache"):
        assert outputs(engine, prompts) == want
        engine.core.hicache.flush()
    stats = engine.core.hicache.stats
    assert stats.pages_written >= 10 and stats.bytes_written == 0
    assert stats.disk_write_failures == stats.pages_written
    logged = hicache_warnings(caplog)
    assert len(logged) == 2, logged
    assert "cannot write page" in logged[0] and "first write failure" in logged[0]
    assert "10 write failures so far" in logged[1]


def test_a_directory_deleted_while_running_is_made_again(llama_dir, make_engine, tmp_path):
    kv = tmp_path / "kv"
    engine = make_engine(llama_dir, hicache_dir=str(kv), **HC)
    prompts = long_prompts(engine.model_config.vocab_size)
    outputs(engine, prompts)
    engine.core.hicache.flush()
    shutil.rmtree(kv)
    later = [[t % 300 + 1 for t in p] for p in prompts]
    want = outputs(engine, later)
    engine.core.hicache.flush()
    assert list(kv.rglob("*.page")), "the disk tier stayed dead after its directory went"
    assert engine.core.hicache.stats.disk_write_failures == 0
    restarted = make_engine(llama_dir, hicache_dir=str(kv), **HC)
    assert outputs(restarted, later) == want
    assert restarted.core.hicache.stats.disk_hit_tokens > 0


# ---------------------------------------------------------------- the store itself


def test_a_corrupt_page_in_a_read_only_directory_is_a_miss(tmp_path, undeletable_pages):
    """Corrupt pages that cannot be deleted (found at the start's scan, or at a read) are
    misses that are not looked up again, and a start over capacity keeps going."""
    disk = DiskPageStore(tmp_path, FP, 1 << 20)
    for i in range(4):
        assert disk.put(KEYS[i], page(i))
    disk.close()
    for key, at in ((KEYS[0], 20), (KEYS[1], PAGE_BYTES - 3)):  # header, payload
        data = bytearray(disk.path(key).read_bytes())
        data[at] ^= 0x10
        disk.path(key).write_bytes(bytes(data))
    again = DiskPageStore(tmp_path, FP, 1 << 20)  # the scan meets the bad header
    assert len(again) == 3 and not again.contains(KEYS[0])
    assert again.get(KEYS[1]) is None  # the payload's checksum fails
    assert not again.contains(KEYS[1]) and again.path(KEYS[1]).exists()
    assert again.stats.corrupt == 2 and again.get(KEYS[2]) == page(2)
    again.check()
    again.close()
    small = DiskPageStore(tmp_path, FP, PAGE_BYTES)  # over capacity, nothing deletable
    assert small.used_bytes <= PAGE_BYTES
    small.check()


def test_a_page_of_another_geometry_under_a_key_is_a_deleted_miss(tmp_path):
    """A valid page of this model but another page size under one of this engine's keys (a
    file copied or renamed in): the promotion is a miss, not an exception in the engine."""
    geo = page_geometry(L, H, D, torch.float32, P)
    host = HostPagePool(4, geo.total_size, fingerprint=FP)
    disk = DiskPageStore(tmp_path, FP, 1 << 20, geometry=geo)
    io = DiskIO(disk, host, geo, queue_pages=4)
    try:
        for key, tokens in ((KEYS[0], 2 * P), (KEYS[1], P // 2)):
            disk.path(key).parent.mkdir(parents=True, exist_ok=True)
            disk.path(key).write_bytes(page(7, tokens))
            fut = io.promote(key)
            assert fut is not None and fut.result(timeout=30) is False
            assert not host.contains(key) and not disk.path(key).exists()
        assert disk.stats.corrupt == 2 and disk.stats.hits == 0
        host.check()
    finally:
        io.close()


def test_a_second_writer_of_the_directory_is_warned(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="phaseflip.hicache"):
        first = DiskPageStore(tmp_path, FP, 1 << 20)
        assert not hicache_warnings(caplog)
        DiskPageStore(tmp_path, FP, 1 << 20).close()
        logged = hicache_warnings(caplog)
        assert len(logged) == 1 and "in use by another engine" in logged[0], logged
        first.close()
        caplog.clear()
        DiskPageStore(tmp_path, FP, 1 << 20).close()  # the first one is gone
        assert not hicache_warnings(caplog)


def test_a_directory_that_cannot_be_made_is_a_typed_error_naming_the_flag(llama_dir, tmp_path):
    from phaseflip import Engine, InvalidRequestError

    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match="--hicache-dir .*cannot use it"):
        Engine(str(llama_dir), device="cpu", hicache_dir=str(tmp_path / "file" / "kv"), **HC)
