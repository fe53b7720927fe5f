"""The plan sent to other ranks carries only each request-table row's new slots, and on one
node travels as a step frame of int64 words rather than a pickle.

The end-to-end guard is the distributed suite: every TP/PP test runs with
`check_accounting`, which ships the full `kv_indices` too and makes every rank compare its
rebuilt copy (a difference stops the group). These tests pin the codec itself: every plan of
every test goes through both wire forms, and the frame's must equal the pickle's.
"""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from phaseflip.cache.hicache.transfer import TransferOrders
from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.distributed.plan_codec import (
    PlanDecoder,
    PlanDelta,
    PlanEncoder,
    PlanFrameError,
    StepFrame,
    StepMessage,
    decode_frame,
    is_frame,
)
from phaseflip.forward_batch import ForwardBatch


def _plan(table: ReqToTokenTable, rows: list[int], prefix: list[int], ext: list[int]):
    ids = [1] * sum(ext)
    logits = list(np.cumsum(ext) - 1)
    return ForwardBatch.from_table(table.table, rows, prefix, ext, ids, logits, table.epochs)


def _frame_bytes(msg: StepMessage) -> bytearray:
    frame = StepFrame.of(msg)
    assert frame is not None
    buf = bytearray(frame.nbytes)
    frame.fill(memoryview(buf))
    assert is_frame(buf) and not is_frame(pickle.dumps(msg))
    return buf


def assert_same_message(got: StepMessage, want: StepMessage) -> None:
    """Field by field, the plan's and its delta's arrays by value (lists stay lists)."""
    for f in ("step", "fence", "future_len", "whole", "transfers"):
        assert getattr(got, f) == getattr(want, f), f
    assert _same(got.future_ids, want.future_ids)
    g, w = got.plan, want.plan
    for f in ("extend_lens", "prefix_lens", "max_position"):
        assert getattr(g, f) == getattr(w, f) and type(getattr(g, f)) is type(getattr(w, f))
    for f in ("input_ids", "positions", "out_cache_loc", "kv_indptr", "logits_indices",
              "kv_indices", "rows", "row_epochs", "future_pos", "future_rows"):
        assert _same(getattr(g, f), getattr(w, f)), f
    for f in ("seq_lens", "reset", "starts", "slots", "full"):
        assert _same(getattr(g.delta, f), getattr(w.delta, f)), f
    assert g.delta.reset.dtype == np.bool_


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return np.array_equal(np.asarray(a), np.asarray(b))


def _roundtrip(enc: PlanEncoder, dec: PlanDecoder, plan: ForwardBatch) -> ForwardBatch:
    """Through both wire forms: the frame's message must equal the pickle's; the pickle's is
    rebuilt (the mirror advances once)."""
    wire = StepMessage(7, enc.encode(plan), future_len=2, future_ids=np.array([5, 6]))
    pickled = pickle.loads(pickle.dumps(wire))
    assert pickled.plan.kv_indices.size == 0
    assert_same_message(decode_frame(_frame_bytes(wire)), pickled)
    return dec.decode(pickled.plan)


def test_rows_grow_reset_and_are_reused():
    table = ReqToTokenTable(4, 64)
    enc, dec = PlanEncoder(check=True), PlanDecoder()
    rng = np.random.default_rng(0)
    a, b = table.alloc(), table.alloc()
    table.write(a, 0, torch.from_numpy(rng.integers(1, 999, 20)))
    table.write(b, 0, torch.from_numpy(rng.integers(1, 999, 9)))
    plans = [_plan(table, [a, b], [0, 0], [12, 9])]  # prefill
    for n in range(12, 18):  # decode a while b waits, then both
        table.write(a, n, torch.tensor([rng.integers(1, 999)]))
        plans.append(_plan(table, [a], [n], [1]))
    table.write(a, 0, torch.from_numpy(rng.integers(1, 999, 8)))  # prefix rewritten: new epoch
    plans.append(_plan(table, [a, b], [17, 8], [1, 1]))
    table.free(b)
    c = table.alloc()  # the same row, a new occupant with a shorter context
    assert c == b
    table.write(c, 0, torch.from_numpy(rng.integers(1, 999, 5)))
    plans.append(_plan(table, [c, a], [4, 18], [1, 1]))
    for plan in plans:
        got = _roundtrip(enc, dec, plan)
        assert torch.equal(got.kv_indices, plan.kv_indices)


def test_a_decode_step_sends_one_slot_a_row():
    table = ReqToTokenTable(257, 1100)
    rows = [table.alloc() for _ in range(256)]
    for r in rows:
        table.write(r, 0, torch.arange(1, 1026) + 2000 * r)
    enc, dec = PlanEncoder(), PlanDecoder()
    _roundtrip(enc, dec, _plan(table, rows, [0] * 256, [1024] * 256))
    for r in rows:
        table.write(r, 1024, torch.tensor([7]))
    step = enc.encode(_plan(table, rows, [1024] * 256, [1] * 256))
    assert step.delta.slots.shape == (256,)
    assert len(pickle.dumps(step)) < 40_000  # the whole plan pickles to ~2 MB


def test_a_mirror_that_disagrees_stops_the_rank():
    table = ReqToTokenTable(2, 16)
    r = table.alloc()
    table.write(r, 0, torch.arange(1, 9))
    enc, dec = PlanEncoder(check=True), PlanDecoder()
    _roundtrip(enc, dec, _plan(table, [r], [0], [6]))
    table.table[r, 2] = 99  # a rewrite that bypasses the epoch: the mirror is now stale
    with pytest.raises(RuntimeError, match="plan disagreement"):
        _roundtrip(enc, dec, _plan(table, [r], [6], [1]))


def test_random_steps_rebuild_every_plan():
    """Rows come and go, grow, get rewritten (new epoch) and skip steps, in random order; the
    rebuilt `kv_indices` always equals the driver's (the mirror check raises otherwise)."""
    rng = np.random.default_rng(1)
    table = ReqToTokenTable(40, 256)
    enc, dec = PlanEncoder(check=True), PlanDecoder()
    lens: dict[int, int] = {}
    for _ in range(300):
        if len(lens) < 30 and rng.random() < 0.3:
            r = table.alloc()
            lens[r] = int(rng.integers(1, 40))
            table.write(r, 0, torch.from_numpy(rng.integers(1, 999, lens[r])))
        live = sorted(lens)
        if live and rng.random() < 0.1:  # one finishes, its row is reused later
            r = live[int(rng.integers(len(live)))]
            table.free(r)
            del lens[r]
            continue
        if live and rng.random() < 0.1:  # a prefix rewritten from position 0: a new epoch
            r = live[int(rng.integers(len(live)))]
            table.write(r, 0, torch.from_numpy(rng.integers(1, 999, 3)))
        step = [r for r in live if r in lens and lens[r] < 250 and rng.random() < 0.8]
        if not step:
            continue
        rng.shuffle(step)
        for r in step:
            table.write(r, lens[r], torch.tensor([int(rng.integers(1, 999))]))
        plan = _plan(table, step, [lens[r] for r in step], [1] * len(step))
        for r in step:
            lens[r] += 1
        got = _roundtrip(enc, dec, plan)
        assert torch.equal(got.kv_indices, plan.kv_indices)


def _decode_step(check: bool) -> StepMessage:
    table = ReqToTokenTable(9, 64)
    rows = [table.alloc() for _ in range(8)]
    for r in rows:
        table.write(r, 0, torch.arange(1, 12) + 100 * r)
    enc = PlanEncoder(check=check)
    plan = ForwardBatch.from_table(table.table, rows, [10] * 8, [1] * 8,
                                   [-1 - i for i in range(8)], list(range(8)), table.epochs)
    return StepMessage(3, enc.encode(plan), None, fence=True, future_len=8, whole=True)


@pytest.mark.parametrize("check", [False, True])
def test_a_decode_step_with_placeholders_survives_the_frame(check: bool):
    """Run-ahead placeholders, flags, the checking mode's full kv_indices; the rebuilt plan
    is the same as from the pickle, and its arrays are views of the frame (no copy)."""
    msg = _decode_step(check)
    buf = _frame_bytes(msg)
    got = decode_frame(buf)
    assert_same_message(got, pickle.loads(pickle.dumps(msg)))
    assert got.plan.future_pos is not None
    assert (got.plan.delta.full is not None) == check
    assert np.shares_memory(got.plan.delta.slots, np.frombuffer(buf, dtype=np.uint8))
    assert isinstance(got.plan.delta, PlanDelta)
    plan = PlanDecoder().decode(got.plan)
    assert torch.equal(plan.input_ids, torch.from_numpy(msg.plan.input_ids))


def test_messages_without_a_frame_are_pickled():
    msg = _decode_step(False)
    assert StepFrame.of(dataclasses.replace(msg, transfers=TransferOrders(
        load_frames=[1], load_slots=[torch.tensor([2])]))) is None  # HiCache orders: pickled
    assert StepFrame.of(dataclasses.replace(msg, plan=None)) is None  # a fence
    assert StepFrame.of(dataclasses.replace(msg, plan=dataclasses.replace(
        msg.plan, delta=None))) is None  # a plan sent whole
    assert StepFrame.of("stop") is None


@pytest.mark.parametrize("damage", ["short", "bit", "length", "count", "magic", "odd"])
def test_a_damaged_frame_is_an_error_not_a_plan(damage: str):
    buf = _frame_bytes(_decode_step(True))
    words = np.frombuffer(buf, dtype=np.int64)
    if damage == "short":  # cut at a word boundary, its length word kept
        buf = buf[: len(buf) - 16]
    elif damage == "bit":  # one slot changed in the middle of the arrays
        buf[len(buf) // 2] ^= 0x10
    elif damage == "length":  # one array's length moved to the next: sums still good
        words[8] += 1
        words[9] -= 1
    elif damage == "count":  # a length past the frame, checksum made good
        words[8] += 1
        words[2] -= 1
    elif damage == "magic":
        buf[0:8] = b"PFSTEP99"
    else:
        buf = buf[:-3]
    match = {"short": "says", "bit": "checksum", "length": "lengths disagree",
             "count": "do not add up", "magic": "says", "odd": "whole words"}[damage]
    with pytest.raises(PlanFrameError, match=match):
        decode_frame(buf)
