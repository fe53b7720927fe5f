"""The plan sent to other ranks carries only each request-table row's new slots.

The end-to-end guard is the distributed suite: every TP/PP test runs with
`check_accounting`, which ships the full `kv_indices` too and makes every rank compare its
rebuilt copy (a difference stops the group). These tests pin the codec itself.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from phaseflip.cache.kv_pool import ReqToTokenTable
from phaseflip.distributed.plan_codec import PlanDecoder, PlanEncoder
from phaseflip.forward_batch import ForwardBatch


def _plan(table: ReqToTokenTable, rows: list[int], prefix: list[int], ext: list[int]):
    ids = [1] * sum(ext)
    logits = list(np.cumsum(ext) - 1)
    return ForwardBatch.from_table(table.table, rows, prefix, ext, ids, logits, table.epochs)


def _roundtrip(enc: PlanEncoder, dec: PlanDecoder, plan: ForwardBatch) -> ForwardBatch:
    wire = pickle.loads(pickle.dumps(enc.encode(plan)))
    assert wire.kv_indices.size == 0
    return dec.decode(wire)


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
