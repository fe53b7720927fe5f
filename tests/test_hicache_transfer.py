"""HiCache transfers: whole-page copies between a rank's KV pool slice and (shared) host frames.

Every TP/PP rank writes exactly its byte ranges of the canonical page, so the frame the ranks of
any geometry fill together is byte-identical to the page one full-pool rank writes, and every
rank of any other geometry loads its slice back from it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from phaseflip.cache.hicache import (
    HostFrames,
    KVTransferEngine,
    TransferOrders,
    decode_page,
    encode_page,
    gather_page,
    page_header,
    payload_tensor,
    rank_slice,
)
from phaseflip.cache.hicache.frames import page_geometry
from phaseflip.cache.hicache.transfer import LocalChannel
from phaseflip.cache.kv_pool import KVPool
from phaseflip.layout import Layout

L, H, D, P = 4, 4, 8, 16
FP = bytes(range(16))
GEO = page_geometry(L, H, D, torch.float32, P)


def kv_of(pool: KVPool) -> torch.Tensor:
    """The pool's K and V as one `[layers, k|v, slots, heads, dim]` tensor (a copy)."""
    return torch.stack([torch.stack((k, v)) for k, v in zip(pool.k, pool.v)])


def fill(pool: KVPool, kv: torch.Tensor) -> None:
    for i, (k, v) in enumerate(zip(pool.k, pool.v)):
        k.copy_(kv[i, 0])
        v.copy_(kv[i, 1])


def full_pool(seed: int = 0, slots: int = 96) -> KVPool:
    pool = KVPool(slots, (0, L), H, D, torch.float32, "cpu")
    fill(pool, torch.randn((L, 2, slots, H, D), generator=torch.Generator().manual_seed(seed)))
    return pool


def rank_pool(full: KVPool, layout: Layout) -> tuple[KVPool, object]:
    """The pool a rank of `layout` would hold, filled with its slice of `full`."""
    part = rank_slice(layout, L, H)
    pool = KVPool(full.num_slots, (part.layers.start, part.layers.stop), len(part.heads), D,
                  torch.float32, "cpu")
    fill(pool, kv_of(full)[part.layers.start : part.layers.stop, :, :,
                           part.heads.start : part.heads.stop])
    return pool, part


def pages_of(n: int, seed: int = 1) -> list[torch.Tensor]:
    perm = torch.randperm(95, generator=torch.Generator().manual_seed(seed))[: n * P] + 1
    return list(perm.view(n, P))


def test_store_writes_the_canonical_page_and_load_reads_it_back() -> None:
    pool = full_pool()
    frames = HostFrames.private(3, GEO.total_size)
    engine = KVTransferEngine(pool, frames, GEO, rank_slice(Layout(), L, H), torch.device("cpu"))
    pages = pages_of(3)
    engine.execute(TransferOrders(store_frames=[2, 0, 1], store_slots=pages)).wait()
    for frame, slots in zip([2, 0, 1], pages):
        buf = frames.frame(frame, GEO.total_size)
        off = GEO.payload_offset
        buf[:off].copy_(torch.frombuffer(bytearray(page_header(GEO, FP)), dtype=torch.uint8))
        sealed = page_header(GEO, FP, memoryview(buf[off:].numpy())) + buf[off:].numpy().tobytes()
        assert sealed == encode_page(*gather_page(pool.k, pool.v, slots), FP)
    other = KVPool(96, (0, L), H, D, torch.float32, "cpu")
    back = KVTransferEngine(other, frames, GEO, rank_slice(Layout(), L, H), torch.device("cpu"))
    dst = pages_of(3, seed=7)
    back.execute(TransferOrders(load_frames=[2, 0, 1], load_slots=dst)).wait()
    got, want = kv_of(other), kv_of(pool)
    for src, slots in zip(pages, dst):
        assert torch.equal(got[:, :, slots], want[:, :, src])
    untouched = torch.ones(96, dtype=torch.bool)
    untouched[torch.cat(dst)] = False
    assert not got[:, :, untouched].any()


@pytest.mark.parametrize(("write", "read"), [((2, 1), (1, 2)), ((1, 2), (2, 2)),
                                             ((2, 2), (1, 1)), ((4, 1), (1, 3))])
def test_ranks_of_one_geometry_write_what_another_reads(write, read, tmp_path) -> None:
    """The cross-layout property the phase flip relies on, on real shared memory: ranks of
    geometry `write` store their slices into one shared frame; it equals the full page; the
    ranks of geometry `read` (another mapping of the same memory) load their slices from it."""
    full = full_pool(seed=3)
    src, dst = pages_of(2, seed=4), pages_of(2, seed=5)
    shm = HostFrames.create_shared(tmp_path / "frames", 2, GEO.total_size)
    try:
        tp, pp = write
        for rank in range(tp * pp):
            layout = Layout(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp)
            pool, part = rank_pool(full, layout)
            mapped = HostFrames.open_shared(shm.path, GEO.total_size)  # the rank's own mapping
            KVTransferEngine(pool, mapped, GEO, part, torch.device("cpu")).execute(
                TransferOrders(store_frames=[1, 0], store_slots=src)).wait()
        for frame, slots in zip([1, 0], src):
            k, v = gather_page(full.k, full.v, slots)
            got = payload_tensor(shm.frame(frame), GEO)
            assert torch.equal(got[:, 0], k) and torch.equal(got[:, 1], v)
        tp, pp = read
        whole = torch.zeros((L, 2, 96, H, D))
        for rank in range(tp * pp):
            layout = Layout(tp_rank=rank % tp, tp_size=tp, pp_rank=rank // tp, pp_size=pp)
            part = rank_slice(layout, L, H)
            pool = KVPool(96, (part.layers.start, part.layers.stop), len(part.heads), D,
                          torch.float32, "cpu")
            mapped = HostFrames.open_shared(shm.path, GEO.total_size)
            KVTransferEngine(pool, mapped, GEO, part, torch.device("cpu")).execute(
                TransferOrders(load_frames=[1, 0], load_slots=dst)).wait()
            whole[part.layers.start : part.layers.stop, :, :,
                  part.heads.start : part.heads.stop] = kv_of(pool)
        for s, d in zip(src, dst):
            assert torch.equal(whole[:, :, d], kv_of(full)[:, :, s])
    finally:
        shm.close()
    assert not shm.path.exists()


def test_replicated_kv_head_is_written_by_one_rank() -> None:
    """MQA under tp=2: both ranks hold head 0; only rank 0 writes it, both read it."""
    parts = [rank_slice(Layout(tp_rank=r, tp_size=2), L, 1) for r in range(2)]
    assert [(p.heads, p.writer) for p in parts] == [(range(0, 1), True), (range(0, 1), False)]
    geo = page_geometry(L, 1, D, torch.float32, P)
    frames = HostFrames.private(1, geo.total_size)
    frames.buf.zero_()
    pool = KVPool(96, (0, L), 1, D, torch.float32, "cpu")
    fill(pool, torch.randn((L, 2, 96, 1, D)))
    engine = KVTransferEngine(pool, frames, geo, parts[1], torch.device("cpu"))
    engine.execute(TransferOrders(store_frames=[0], store_slots=pages_of(1))).wait()
    assert not frames.buf.any()  # the non-writer copied nothing


def test_copies_are_asynchronous_and_ordered_before_the_next_forward() -> None:
    """Issuing returns at once while the copy runs; `order_before_forward` waits for it."""
    pool = full_pool()
    frames = HostFrames.private(1, GEO.total_size)
    engine = KVTransferEngine(pool, frames, GEO, rank_slice(Layout(), L, H), torch.device("cpu"))
    gate = threading.Event()
    engine.before_copy = lambda _orders: gate.wait(10)
    channel = LocalChannel(engine)
    ticket = channel.dispatch(TransferOrders(store_frames=[0], store_slots=pages_of(1)))
    time.sleep(0.05)
    assert not channel.done(ticket) and not channel.visible(ticket)
    threading.Timer(0.1, gate.set).start()
    engine.order_before_forward()
    assert channel.done(ticket)
    assert payload_tensor(frames.frame(0), GEO).any()


def test_shared_frames_refuse_what_tmpfs_cannot_hold(tmp_path) -> None:
    with pytest.raises(OSError, match="hicache-host-gb"):
        HostFrames.create_shared(tmp_path / "huge", 1 << 40, 1 << 20)
    assert not (tmp_path / "huge").exists()


def test_decode_of_a_stored_frame_after_sealing() -> None:
    """The disk encoding of a host frame is header-sealed in place of the unsealed header."""
    pool = full_pool(seed=9)
    frames = HostFrames.private(1, GEO.total_size)
    engine = KVTransferEngine(pool, frames, GEO, rank_slice(Layout(), L, H), torch.device("cpu"))
    slots = pages_of(1)[0]
    engine.execute(TransferOrders(store_frames=[0], store_slots=[slots])).wait()
    body = frames.frame(0, GEO.total_size)[GEO.payload_offset :].numpy().tobytes()
    k, v = decode_page(page_header(GEO, FP, body) + body, FP)
    kv = kv_of(pool)
    assert torch.equal(k, kv[:, 0, slots].transpose(1, 2))
    assert torch.equal(v, kv[:, 1, slots].transpose(1, 2))
