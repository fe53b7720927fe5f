"""The shared-memory plan channel between real processes (gloo for the handshake): every rank
gets every message in order whatever its size, waits without a deadline when rank 0 is idle,
notices rank 0's death at once, and a reader that stops reading is a named error, not a hang.

Every test runs under a deadline: a lost wake-up fails instead of hanging CI.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import signal
import time

import numpy as np
import pytest

from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.distributed.plan_channel import (
    GlooPlanChannel,
    ShmPlanChannel,
    StagePipes,
    plan_channel,
)
from phaseflip.distributed.plan_codec import PlanEncoder, StepFrame, StepMessage
from phaseflip.forward_batch import ForwardBatch

pytestmark = pytest.mark.timeout(120, method="thread")
GROUP_TIMEOUT_S = 1.0  # the idle test waits past it


def _messages() -> list[object]:
    big = np.arange(10_000, dtype=np.int64)  # 80 KB: streams through a 4 KiB ring
    return ([{"step": i, "ids": list(range(i % 7))} for i in range(300)]
            + _steps() + [big, "x" * 5000, ("relayout", 2, 1)])


def _steps() -> list[StepMessage]:
    """Step messages that travel as frames (`plan_codec.StepFrame`), pickles between them: a
    prompt of 6 KB (larger than the 4 KiB ring: streams through it), decode steps of 1.2 KB
    (in place, or through a copy where one would cross the ring's end) and a checked step."""
    import torch

    table = ReqToTokenTable(9, 256)
    rows = [table.alloc() for _ in range(8)]
    for r in rows:
        table.write(r, 0, torch.arange(1, 201) + 1000 * r)
    enc, check = PlanEncoder(), PlanEncoder(check=True)
    out: list[StepMessage] = []
    for k, n in enumerate([0, *range(20, 34), 40]):
        ext = [20] * 8 if n == 0 else [1] * 8
        ids = [3] * sum(ext) if n == 0 else [-1 - i for i in range(8)]
        plan = ForwardBatch.from_table(table.table, rows, [n] * 8, ext, ids,
                                       list(np.cumsum(ext) - 1), table.epochs)
        codec = check if n == 40 else enc
        out.append(StepMessage(k, codec.encode(plan), future_len=8 if n else 0))
        out.append({"between": k})
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, StepMessage):  # the same words again: every field came back
        fa, fb = StepFrame(a), StepFrame(b)
        ba, bb = bytearray(fa.nbytes), bytearray(fb.nbytes)
        fa.fill(memoryview(ba))
        fb.fill(memoryview(bb))
        return ba == bb
    return a == b


def _rank_main(rank: int, world: int, port: int, scenario: str, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    group = dist.new_group(backend="gloo",
                           timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    spin = 0.0 if rank == 1 else 50e-6  # rank 1 always sleeps on its doorbell
    chan = ShmPlanChannel(rank, world, group, capacity=4096, spin_s=spin, full_stall_s=1.0)
    try:
        globals()[f"_{scenario}"](rank, chan, out)
    except Exception as e:  # noqa: BLE001 — the test inspects it
        out.put((rank, "error", f"{type(e).__name__}: {e}"))
    out.put((rank, "done", None))
    out.close()
    out.join_thread()  # flushed before the exit below
    os._exit(0)  # no teardown: a killed peer must not hang it


def _order(rank: int, chan: ShmPlanChannel, out) -> None:
    msgs = _messages()
    if rank == 0:
        for m in msgs[:-1]:
            chan.send(m)
        time.sleep(3 * GROUP_TIMEOUT_S)  # idle: the readers wait past the group timeout
        chan.send(msgs[-1])
        out.put((rank, "dir", sorted(os.listdir("/dev/shm"))))
        return
    got = [chan.recv() for _ in msgs]
    same = all(_same(a, b) for a, b in zip(got, msgs))
    out.put((rank, "same", same))


def _death(rank: int, chan: ShmPlanChannel, out) -> None:
    if rank == 0:
        chan.send("hello")
        time.sleep(60)  # killed by the test
        return
    out.put((rank, "first", chan.recv()))
    chan.recv()  # rank 0 is killed while this rank waits


def _idle(rank: int, chan: ShmPlanChannel, out) -> None:
    if rank == 0:
        for i in range(50):  # a busy spell: the reader learns to spin between messages
            chan.send(i)
            time.sleep(0.004)
        out.put((rank, "sent", None))
        time.sleep(60)  # then idle (killed by the test)
        return
    chan.spin_s = 2e-3  # the default, whatever the scenario's spawner set
    for _ in range(50):
        chan.recv()
    chan.recv()  # never comes: this rank must fall asleep


def _full(rank: int, chan: ShmPlanChannel, out) -> None:
    if rank == 0:
        for _ in range(4):
            chan.send(b"y" * 3000)
        return
    chan.recv()
    time.sleep(10)  # reads nothing more


def _pipes(rank: int, chan: ShmPlanChannel, out) -> None:
    """Hidden states one way, logits back, as a two-stage step does; then a hand-off that
    never comes."""
    import torch

    pipes = StagePipes(None, timeout_s=1.0, capacity=4096)
    shapes = [((2, 3, 5), torch.float32), ((2, 700, 8), torch.bfloat16), ((0, 4), torch.float32)]
    if rank == 0:
        for i, (shape, dtype) in enumerate(shapes):
            pipes.send(torch.full(shape, float(i), dtype=dtype), 1)
        back = pipes.recv((64, 100), torch.float32, 1)  # 25.6 KB through a 4 KiB ring
        out.put((rank, "same", bool((back == torch.arange(100.0)).all())))
        return
    # a received tensor may lie in the ring, valid until the next receive from its sender
    got = [pipes.recv(shape, dtype, 0).clone() for shape, dtype in shapes]
    ok = all(g.dtype == d and g.shape == s and bool((g == i).all())
             for i, (g, (s, d)) in enumerate(zip(got, shapes)))
    back = torch.arange(100.0).repeat(64, 1)
    pipes.send_parts([back[:24], back[24:]], 0)  # two micro-batches' logits: one hand-off
    out.put((rank, "same", ok))
    pipes.recv((4,), torch.float32, 0)  # never sent: a named error after the deadline


def _spawn(world: int, scenario: str):
    from phaseflip.distributed.group import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, scenario, out), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, out


def _collect(out, want: int, timeout_s: float = 60) -> list[tuple]:
    got, end = [], time.monotonic() + timeout_s
    while len([g for g in got if g[1] == "done"]) < want:
        try:
            got.append(out.get(timeout=max(0.1, end - time.monotonic())))
        except queue.Empty:
            pytest.fail(f"ranks did not finish: {got}")
    return got


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)


def test_every_rank_gets_every_message_in_order_and_waits_when_idle():
    procs, out = _spawn(3, "order")
    try:
        got = _collect(out, 3)
    finally:
        _stop(procs)
    assert not [g for g in got if g[1] == "error"], got
    assert sorted(g[0] for g in got if g[1] == "same" and g[2]) == [1, 2]
    left = next(g[2] for g in got if g[1] == "dir")
    assert not [n for n in left if n.startswith("phaseflip-plans-")], left  # unlinked


def test_a_waiting_rank_notices_rank_0_dying_at_once():
    procs, out = _spawn(2, "death")
    try:
        first = out.get(timeout=60)
        assert first == (1, "first", "hello")
        time.sleep(0.5)  # rank 1 is asleep on its doorbell now
        os.kill(procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        err = out.get(timeout=30)
        assert time.monotonic() - killed < 5
    finally:
        _stop(procs)
    assert err[:2] == (1, "error") and "DriverGoneError" in err[2], err


def test_a_reader_that_stops_reading_is_a_named_error():
    procs, out = _spawn(2, "full")
    try:
        got = _collect(out, 1)
    finally:
        _stop(procs)
    errors = [g for g in got if g[1] == "error"]
    assert errors and errors[0][0] == 0 and "rank(s) [1] read nothing" in errors[0][2], got


def test_stage_pipes_hand_tensors_over_and_a_missing_one_is_a_timeout():
    procs, out = _spawn(2, "pipes")
    try:
        got = _collect(out, 2)
    finally:
        _stop(procs)
    assert sorted(g[0] for g in got if g[1] == "same" and g[2]) == [0, 1], got
    errors = [g for g in got if g[1] == "error"]
    assert len(errors) == 1 and errors[0][0] == 1 and "TimeoutError" in errors[0][2], got


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_rank_sleeps():
    """Readers spin between messages of a busy spell (no doorbell to pay), but an idle rank
    stops spinning within SPIN_MAX_S and uses no CPU (idle is idle)."""
    procs, out = _spawn(2, "idle")
    try:
        assert out.get(timeout=60) == (0, "sent", None)
        time.sleep(0.5)  # past the longest spin
        before = _cpu_s(procs[1].pid)
        time.sleep(1.0)
        used = _cpu_s(procs[1].pid) - before
    finally:
        _stop(procs)
    assert used < 0.1, f"an idle rank used {used:.2f} s of CPU in 1 s"


def test_multi_node_groups_keep_the_gloo_broadcast():
    assert isinstance(plan_channel(0, 4, 2, None), GlooPlanChannel)
    assert isinstance(plan_channel(0, 2, 2, None), ShmPlanChannel)


def test_a_frame_across_the_rings_end_is_read_in_place(tmp_path):
    """The ring's data is mapped twice, back to back: a frame that crosses the end is one
    piece (no copy on the reader, e.g. a step's logits on the driver), and a payload read in
    place outlives the ring that held it."""
    from phaseflip.distributed.plan_channel import ShmRing

    writer = ShmRing.create(str(tmp_path), 1, 4096, 5.0, doorbells=False)
    reader = ShmRing(str(tmp_path / "ring"), 1, 0, [], 4096, wait_s=5.0)
    crossed = 0
    for i in range(12):
        payload = bytes([i + 1]) * 1500
        start = (reader.pos + 8) % 4096
        writer.write(payload)
        got = reader.read(view=True)
        assert isinstance(got, memoryview) and bytes(got) == payload
        crossed += start + len(payload) > 4096
    assert crossed >= 3
    kept = np.frombuffer(got, dtype=np.uint8)
    writer.close()
    reader.close()
    assert int(kept.sum()) == 12 * 1500


def test_a_hand_off_reader_spins_before_it_naps(tmp_path, monkeypatch):
    """A stage pipe's reader that finds nothing spins (yielding its core) for its spin time
    before it naps. Past the spin its naps stay at most PIPE_NAP_MAX_S (doubling to 1 ms they
    overslept a hand-off by up to that) and the deadline still holds (law 3: a missing
    hand-off is a named stall). The cap is red without it; the spin was already so."""
    import threading

    from phaseflip.distributed import plan_channel as pc

    writer = pc.ShmRing.create(str(tmp_path), 1, 4096, 5.0, doorbells=False)
    reader = pc.ShmRing(str(tmp_path / "ring"), 1, 0, [], 4096, spin_s=30.0, wait_s=60.0)
    naps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(pc.time, "sleep", lambda s: (naps.append(s), real_sleep(s))[1])
    late = threading.Thread(target=lambda: (threading.Event().wait(0.05),
                                            writer.write(b"x" * 100)))
    late.start()
    got = bytes(reader.read(view=True))
    late.join(10)
    assert got == b"x" * 100 and naps == []
    reader.spin_s, reader.wait_s = 0.0, 0.05
    with pytest.raises(TimeoutError, match="no data from the peer"):
        reader.read()
    assert naps and max(naps) <= pc.PIPE_NAP_MAX_S
    writer.close()
    reader.close()
