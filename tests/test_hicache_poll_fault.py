"""A promotion whose disk read raised in the I/O thread (a crash, not a miss): `poll` re-raises
the error as before, but first ends the promotion as failed. It used to drop the promotion
before the loads waiting on it heard of it, so they stayed PROMOTING for ever with their pages
pinned and their prefix locked, should the engine survive the error: the request was never
admitted and HiCache could never quiesce.
"""

from __future__ import annotations

from concurrent.futures import Future, wait
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from phaseflip import SamplingParams

torch.set_num_threads(1)
HC = {"enable_hicache": True, "hicache_page_size": 8}


def prompt_on_disk(make_engine, llama_dir, kv: Path) -> list[int]:
    """A 33-token prompt (4 full pages and a token) computed once with a disk tier at `kv`,
    which then holds its 4 pages."""
    prompt = torch.randint(1, 300, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    writer = make_engine(llama_dir, hicache_dir=str(kv), **HC)
    writer.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=4), use_tqdm=False)
    writer.core.hicache.flush()
    assert len(writer.core.hicache.disk) == 4
    return prompt


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("bad", [0, 1])
def test_a_read_that_raises_releases_the_loads_waiting_on_it(bad, llama_dir, make_engine,
                                                              tmp_path, monkeypatch):
    """Page `bad` of a 4-page prompt on disk raises in the I/O thread: `poll` raises, the
    load then ends at that page (the pages before it load, the rest are computed again) and
    nothing stays pinned, reserved or in flight."""
    prompt = prompt_on_disk(make_engine, llama_dir, tmp_path / "kv")
    hc = make_engine(llama_dir, hicache_dir=str(tmp_path / "kv"), **HC).core.hicache
    tokens = prompt[: 4 * hc.page_size]
    keys = hc._keys(tokens)
    read_into, promote, futures = hc.disk.read_into, hc.io.promote, []

    def failing_read(key: bytes, out: memoryview) -> int | None:
        if key == keys[bad]:
            raise RuntimeError("I/O thread crash (injected)")
        return read_into(key, out)

    def recorded_promote(key: bytes) -> Future[bool] | None:
        fut = promote(key)
        futures.append(fut)
        return fut

    monkeypatch.setattr(hc.disk, "read_into", failing_read)
    monkeypatch.setattr(hc.io, "promote", recorded_promote)
    req = SimpleNamespace(rid="r")
    assert not hc.prefetch(req, tokens, 0)
    assert len(futures) == 4 and None not in futures
    wait(futures)
    with pytest.raises(RuntimeError, match="injected"):
        hc.poll()
    hc.poll()  # the promotions after the failed one
    hc.channel.fence()
    hc.poll()
    assert hc.prefetch(req, tokens, 0), "the load stayed PROMOTING"
    hc.admitted(req)
    hc.quiesce()
    assert not hc.busy and hc.stats.loads_in_flight == 0 and hc.in_flight_slots == 0
    assert hc.host.pinned_pages == 0
    hc.host.check()
    assert hc.stats.disk_hit_tokens == bad * hc.page_size
    assert int(hc.tree.match_prefix(tokens).slots.numel()) == bad * hc.page_size
