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
        self._sent: dict[int, tuple[int, int]] = {}  # row -> (epoch, length sent)

    def encode(self, plan: ForwardBatch) -> ForwardBatch:
        """The plan to send: `kv_indices` emptied, its content in `plan.delta`-style fields
        (returned as a copy; `plan` itself is left whole for rank 0's own use)."""
        if plan.rows is None or plan.row_epochs is None:
            return plan  # not from the request table: send it whole
        indptr = plan.kv_indptr.numpy()
        kv = plan.kv_indices.numpy()
        seq_lens = np.diff(indptr)
        b = len(seq_lens)
        reset = np.zeros(b, dtype=bool)
        starts = np.zeros(b, dtype=np.int64)
        sent = self._sent
        for i, (row, epoch, n) in enumerate(zip(plan.rows.tolist(), plan.row_epochs.tolist(),
                                                 seq_lens.tolist())):
            last = sent.get(row)
            if last is None or last[0] != epoch:
                reset[i] = True
            else:
                starts[i] = min(last[1], n)
            sent[row] = (epoch, n)
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
    """A receiving rank's side: the mirror of every row, and the plan rebuilt from it."""

    def __init__(self) -> None:
        self._rows: dict[int, np.ndarray] = {}

    def decode(self, plan: ForwardBatch) -> ForwardBatch:
        delta: PlanDelta | None = plan.delta
        if delta is None:
            return plan
        parts, at = [], 0
        for i, (row, n, start) in enumerate(zip(plan.rows.tolist(), delta.seq_lens.tolist(),
                                                 delta.starts.tolist())):
            mirror = self._rows.get(row)
            if mirror is None or mirror.shape[0] < n:
                grown = np.zeros(max(n, 2 * (0 if mirror is None else mirror.shape[0]), 64),
                                 dtype=np.int64)
                if mirror is not None and not delta.reset[i]:
                    grown[: mirror.shape[0]] = mirror
                mirror = self._rows[row] = grown
            k = n - start
            mirror[start:n] = delta.slots[at : at + k]
            at += k
            parts.append(mirror[:n])
        kv = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        if delta.full is not None and not np.array_equal(kv, delta.full):
            bad = int(np.flatnonzero(kv != delta.full)[0]) if kv.shape == delta.full.shape \
                else -1
            raise RuntimeError(
                "plan disagreement: this rank rebuilt kv_indices that differ from rank 0's "
                f"(first difference at {bad}; {kv.shape[0]} vs {delta.full.shape[0]} slots)")
        tensors = {f: torch.from_numpy(getattr(plan, f)) for f in TENSOR_FIELDS}
        return dataclasses.replace(plan, **tensors, kv_indices=torch.from_numpy(kv), delta=None)


def _ranges(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenated aranges [begin[i], end[i]) without a Python loop."""
    lens = end - begin
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.repeat(begin - np.cumsum(lens) + lens, lens)
    return np.arange(total, dtype=np.int64) + offsets
