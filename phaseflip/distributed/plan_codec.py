"""The plan as it travels to the other ranks: each row's new slots instead of its whole context.

A forward plan lists every sequence's whole context (`kv_indices`): at batch 256 with 1k
contexts that is 2 MB of slots a step, pickled, broadcast over gloo and unpickled on every rank
before the rank can launch its part — measured 3.8 ms on the driver and 5.9 ms until rank 1
holds it on a CPU box (`benchmarks/bench_plan_broadcast.py`), most of it repeating what every
rank already received the step before.

So rank 0 sends, per sequence, only what the receiver does not have: the slots past what it
sent for that request-table row before, or the whole context when the row's epoch changed
(`ReqToTokenTable.epochs`: a new occupant, or a prefix rewritten from position 0 — within one
epoch a row only grows). Each receiving rank keeps a mirror of those rows and rebuilds the
plan's `kv_indices`; everything else of the plan travels as is. The driver still decides every
slot (law 1): the mirror is a cache of what it said, never a decision. With
`check_accounting` the full `kv_indices` travels too and every rank compares it with its
rebuilt one; a difference stops the group naming both views (law 4).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from phaseflip.forward_batch import ForwardBatch

TENSOR_FIELDS = ("input_ids", "positions", "out_cache_loc", "kv_indptr", "logits_indices")


@dataclass
class PlanDelta:
    """What replaces `kv_indices` on the wire (numpy: cheap to pickle)."""

    seq_lens: np.ndarray  # int64 [B] context length of each sequence
    reset: np.ndarray  # bool [B]: the row's mirror restarts (new epoch)
    starts: np.ndarray  # int64 [B] first position sent for each sequence
    slots: np.ndarray  # int64: the sent positions' slots, sequence after sequence
    full: np.ndarray | None = None  # the whole kv_indices, in checking mode only


class PlanEncoder:
    """Rank 0's side: what each row's mirror on the other ranks holds."""

    def __init__(self, check: bool = False) -> None:
        self.check = check
        # by request-table row: the epoch last sent (-1: never) and the length sent
        self._epoch = np.full(0, -1, dtype=np.int64)
        self._sent = np.zeros(0, dtype=np.int64)

    def encode(self, plan: ForwardBatch) -> ForwardBatch:
        """The plan to send: `kv_indices` emptied, its content in `plan.delta`-style fields
        (returned as a copy; `plan` itself is left whole for rank 0's own use). Array
        operations only (a per-row Python loop cost ~0.2 ms at batch 256 on the critical
        path); a plan's rows are distinct (one per sequence)."""
        if plan.rows is None or plan.row_epochs is None:
            return plan  # not from the request table: send it whole
        indptr = plan.kv_indptr.numpy()
        kv = plan.kv_indices.numpy()
        seq_lens = np.diff(indptr)
        rows = np.asarray(plan.rows, dtype=np.int64)
        epochs = np.asarray(plan.row_epochs, dtype=np.int64)
        if len(rows) and rows.max() >= len(self._epoch):
            grow = max(int(rows.max()) + 1, 2 * len(self._epoch))
            self._epoch = np.concatenate([self._epoch, np.full(grow - len(self._epoch), -1)])
            self._sent = np.concatenate([self._sent, np.zeros(grow - len(self._sent), np.int64)])
        reset = self._epoch[rows] != epochs
        starts = np.where(reset, 0, np.minimum(self._sent[rows], seq_lens))
        self._epoch[rows] = epochs
        self._sent[rows] = seq_lens
        take = _ranges(indptr[:-1] + starts, indptr[1:])
        delta = PlanDelta(seq_lens, reset, starts, kv[take],
                          kv.copy() if self.check else None)
        # numpy on the wire: a torch tensor pickles ~10x slower than an array. A run-ahead
        # plan's placeholders travel with where they are (future_pos/rows): stage 0's TP ranks
        # fill them from the tokens rank 0 shares (`StageExecutor.run`)
        arrays = {f: getattr(plan, f).numpy() for f in TENSOR_FIELDS}
        return dataclasses.replace(plan, **arrays, kv_indices=np.empty(0, dtype=np.int64),
                                   delta=delta)


class PlanDecoder:
    """A receiving rank's side: the mirror of every row, and the plan rebuilt from it.

    The mirrors live in one array (`_store`), row r at [_off[r], _off[r] + _cap[r]), so a
    plan is rebuilt by one scatter and one gather (a per-row Python loop cost ~0.35 ms at
    batch 256 before a rank could start its part). A row that outgrows its region moves to a
    new one of twice the size at the end; when the store is full, the live regions are packed
    into a new one of twice their size (what moves leave behind is dropped then)."""

    def __init__(self) -> None:
        self._store = np.zeros(0, dtype=np.int64)
        self._off = np.zeros(0, dtype=np.int64)
        self._cap = np.zeros(0, dtype=np.int64)
        self._end = 0  # the store's used part

    def decode(self, plan: ForwardBatch) -> ForwardBatch:
        delta: PlanDelta | None = plan.delta
        if delta is None:
            return plan
        rows = np.asarray(plan.rows, dtype=np.int64)
        n = delta.seq_lens
        self._reserve(rows, n)
        off = self._off[rows]
        self._store[_ranges(off + delta.starts, off + n)] = delta.slots
        kv = self._store[_ranges(off, off + n)]
        if delta.full is not None and not np.array_equal(kv, delta.full):
            bad = int(np.flatnonzero(kv != delta.full)[0]) if kv.shape == delta.full.shape \
                else -1
            raise RuntimeError(
                "plan disagreement: this rank rebuilt kv_indices that differ from rank 0's "
                f"(first difference at {bad}; {kv.shape[0]} vs {delta.full.shape[0]} slots)")
        tensors = {f: torch.from_numpy(getattr(plan, f)) for f in TENSOR_FIELDS}
        return dataclasses.replace(plan, **tensors, kv_indices=torch.from_numpy(kv), delta=None)


    def _reserve(self, rows: np.ndarray, lens: np.ndarray) -> None:
        """Every row of `rows` has room for its length in `lens` (content kept)."""
        if len(rows) and rows.max() >= len(self._off):
            grow = max(int(rows.max()) + 1, 2 * len(self._off)) - len(self._off)
            self._off = np.concatenate([self._off, np.zeros(grow, dtype=np.int64)])
            self._cap = np.concatenate([self._cap, np.zeros(grow, dtype=np.int64)])
        short = lens > self._cap[rows]
        for r, m in zip(rows[short].tolist(), lens[short].tolist()):  # rare: doubling
            cap, old, old_cap = max(m, 2 * int(self._cap[r]), 64), self._off[r], self._cap[r]
            if self._end + cap > len(self._store):
                self._compact(cap)
                old = self._off[r]
            self._store[self._end : self._end + old_cap] = self._store[old : old + old_cap]
            self._off[r], self._cap[r] = self._end, cap
            self._end += cap

    def _compact(self, extra: int) -> None:
        """A new store holding every row's region back to back, with room for `extra`."""
        live = int(self._cap.sum())
        store = np.zeros(max(2 * (live + extra), 4096), dtype=np.int64)
        at = 0
        for r in np.flatnonzero(self._cap).tolist():
            c, o = int(self._cap[r]), int(self._off[r])
            store[at : at + c] = self._store[o : o + c]
            self._off[r] = at
            at += c
        self._store, self._end = store, at


def _ranges(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenated aranges [begin[i], end[i]) without a Python loop."""
    lens = end - begin
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.repeat(begin - np.cumsum(lens) + lens, lens)
    return np.arange(total, dtype=np.int64) + offsets
