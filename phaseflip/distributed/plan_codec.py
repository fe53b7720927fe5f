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
import struct
from dataclasses import dataclass

import numpy as np
import torch

from phaseflip.cache.hicache.transfer import TransferOrders
from phaseflip.forward_batch import ForwardBatch
from phaseflip.sampling.last_stage import SampleSpec

TENSOR_FIELDS = ("input_ids", "positions", "out_cache_loc", "kv_indptr", "logits_indices")


@dataclass
class StepMessage:
    """What rank 0 broadcasts for one step: the forward plan (None for a transfer-only fence),
    the HiCache transfer orders every rank executes first, and whether to fence (every rank
    waits for all its copies, then all ranks meet in a barrier). `future_len`: a run-ahead
    step's plan names the previous step's sampled tokens by placeholder (`ForwardBatch`
    `future_pos`/`future_rows`); those `future_len` tokens are on rank 0's device only, and
    reach the other TP ranks of stage 0 by a broadcast on their TP group (`StageExecutor.run`).
    Later stages need no token ids. `sample`: the rows the last stage samples, and how (with
    PP: `sampling/last_stage.py`); their ids go to rank 0 instead of the logits."""

    step: int
    plan: ForwardBatch | None
    transfers: TransferOrders | None = None
    fence: bool = False
    future_len: int = 0
    future_ids: np.ndarray | None = None  # the tokens themselves, when rank 0 runs on the CPU
    # a decode group kept in flight across steps (--pp-async-decode): the pipeline is filled
    # by the other groups' steps, so this step runs whole, as one micro-batch
    whole: bool = False
    sample: SampleSpec | None = None
    # the micro-batches a step with prompt tokens is cut into, rank 0's choice by stage time
    # (`distributed/micro_batch.py`); 0: every stage applies the token rule
    parts: int = 0


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


# ------------------------------------------------------------------ the step frame
# A step's message on the shared-memory channel, instead of a pickle (64 us for the 27 KB of a
# batch-256 decode plan, on the driver's critical path, and an unpickle on every rank): int64
# words, written by one concatenation straight into the ring and read back as views.
#   header: FRAME_MAGIC, the frame's words, checksum, step, flags, future_len, max_position, 0
#   then one length per FRAME_ARRAYS entry (-1: None), then those arrays back to back.
# The checksum makes the sum of every word 0 mod 2**64: a torn, stale or cut frame is an
# error (`PlanFrameError`), never a plan. Lists and bools travel as int64 and come back as
# lists and bools; token ids come back as int64.
FRAME_MAGIC = b"PFSTEP01"  # a pickle starts with b"\x80": the two never mix up
_MAGIC = int.from_bytes(FRAME_MAGIC, "little")
_HEAD = 8
FRAME_ARRAYS = ("input_ids", "positions", "out_cache_loc", "kv_indptr", "logits_indices",
                "extend_lens", "prefix_lens", "rows", "row_epochs", "future_pos",
                "future_rows", "seq_lens", "reset", "starts", "slots", "full", "future_ids",
                "sample_rows", "sample_ints", "sample_floats", "sample_ship")
_FENCE, _WHOLE, _DECODE = 1, 2, 4  # _DECODE: one token a sequence, its lists not sent
_WORD = struct.Struct("<q")


class PlanFrameError(RuntimeError):
    """A step frame that does not hold a whole, intact message (a ring or codec defect)."""


class StepFrame:
    """One step message as words: `nbytes`, and `fill` to write them into a buffer."""

    def __init__(self, msg: StepMessage) -> None:
        plan, d = msg.plan, msg.plan.delta
        sample = msg.sample or SampleSpec(None)  # type: ignore[arg-type]
        floats = None if sample.floats is None else sample.floats.view(np.int64)  # bits
        values = [*(getattr(plan, f) for f in FRAME_ARRAYS[:11]), d.seq_lens, d.reset,
                  d.starts, d.slots, d.full, msg.future_ids, sample.rows, sample.ints, floats,
                  sample.ship]
        # a decode step's lists are all ones and seq_lens - 1: rebuilt, not sent (17 us of
        # list conversion at batch 256)
        decode = len(plan.input_ids) == len(plan.extend_lens)
        if decode:
            values[5] = values[6] = None
        arrays = [None if a is None else np.asarray(a, dtype=np.int64).reshape(-1)
                  for a in values]
        lens = np.array([-1 if a is None else a.size for a in arrays], dtype=np.int64)
        self.parts = [a for a in arrays if a is not None]
        words = _HEAD + len(lens) + sum(a.size for a in self.parts)
        flags = ((_FENCE if msg.fence else 0) | (_WHOLE if msg.whole else 0)
                 | (_DECODE if decode else 0))
        head = np.array([_MAGIC, words, 0, msg.step, flags, msg.future_len, plan.max_position,
                         msg.parts], dtype=np.int64)
        self.parts[:0] = [head, lens]
        self.nbytes = 8 * words

    @staticmethod
    def of(msg: object) -> StepFrame | None:
        """The frame of `msg`, or None when it has none (not a step, no plan, a plan sent
        whole, HiCache orders): then it travels pickled."""
        if not isinstance(msg, StepMessage) or msg.plan is None or msg.transfers:
            return None
        return StepFrame(msg) if isinstance(msg.plan.delta, PlanDelta) else None

    def fill(self, buf: memoryview) -> None:
        """Writes the frame into `buf` (`nbytes` long, e.g. the ring's own memory)."""
        words = np.frombuffer(buf, dtype=np.int64)
        np.concatenate(self.parts, out=words)
        words.view(np.uint64)[2] = -int(words.view(np.uint64).sum()) % (1 << 64)


def is_frame(buf: bytes | bytearray | memoryview) -> bool:
    return len(buf) >= 8 and bytes(buf[:8]) == FRAME_MAGIC


def decode_frame(buf: bytearray | memoryview) -> StepMessage:
    """The message of a step frame, its arrays views of `buf` (which must outlive them)."""
    n = len(buf)
    if n < 8 * (_HEAD + len(FRAME_ARRAYS)) or n % 8:
        raise PlanFrameError(f"a step frame of {n} bytes: shorter than its header, or not "
                             "whole words")
    w = np.frombuffer(buf, dtype=np.int64)
    if int(w[0]) != _MAGIC or int(w[1]) != len(w):
        raise PlanFrameError(f"a step frame of {len(w)} words says {int(w[1])} (magic "
                             f"{_WORD.pack(int(w[0]))!r})")
    if int(w.view(np.uint64).sum()) != 0:
        raise PlanFrameError(f"step frame {int(w[3])}: checksum mismatch (a torn or stale "
                             "frame)")
    lens = w[_HEAD : _HEAD + len(FRAME_ARRAYS)].tolist()
    if min(lens) < -1 or _HEAD + len(lens) + sum(max(k, 0) for k in lens) != len(w):
        raise PlanFrameError(f"step frame {int(w[3])}: array lengths {lens} do not add up "
                             f"to its {len(w)} words")
    got, at = {}, _HEAD + len(lens)
    for name, k in zip(FRAME_ARRAYS, lens):
        got[name] = None if k < 0 else w[at : at + k]
        at += max(k, 0)
    flags = int(w[4])
    _check_shapes(got, int(w[3]), int(w[5]), bool(flags & _DECODE))
    seq = got["seq_lens"]
    delta = PlanDelta(seq, got["reset"].astype(bool), got["starts"], got["slots"], got["full"])
    if flags & _DECODE:
        extend, prefix = [1] * len(seq), (seq - 1).tolist()
    else:
        extend, prefix = got["extend_lens"].tolist(), got["prefix_lens"].tolist()
    plan = ForwardBatch(**{f: got[f] for f in TENSOR_FIELDS}, extend_lens=extend,
                        prefix_lens=prefix,
                        kv_indices=np.empty(0, dtype=np.int64), max_position=int(w[6]),
                        rows=got["rows"], row_epochs=got["row_epochs"], delta=delta,
                        future_pos=got["future_pos"], future_rows=got["future_rows"])
    sample = None
    if got["sample_rows"] is not None:
        ints, floats = got["sample_ints"], got["sample_floats"]
        sample = SampleSpec(got["sample_rows"], None if ints is None else ints.reshape(-1, 4),
                            None if floats is None else floats.view(np.float64).reshape(-1, 3),
                            got["sample_ship"])
    if not 0 <= int(w[7]) <= len(got["input_ids"]):
        raise PlanFrameError(f"step frame {int(w[3])}: {int(w[7])} micro-batches of "
                             f"{len(got['input_ids'])} tokens")
    return StepMessage(int(w[3]), plan, None, bool(flags & _FENCE), int(w[5]),
                       got["future_ids"], bool(flags & _WHOLE), sample, int(w[7]))


def _check_shapes(got: dict[str, np.ndarray | None], step: int, future_len: int,
                  decode: bool) -> None:
    """The arrays of one plan agree in length (a frame whose lengths add up can still have
    them shifted from one array to the next)."""
    n = {k: -1 if v is None else len(v) for k, v in got.items()}
    b, seq, starts = n["seq_lens"], got["seq_lens"], got["starts"]
    lists = -1 if decode else b  # a decode step's lists are not sent
    need = [b >= 0, n["kv_indptr"] == b + 1, n["extend_lens"] == n["prefix_lens"] == lists,
            n["positions"] == n["input_ids"] == n["out_cache_loc"],
            not decode or n["input_ids"] == b,
            n["future_pos"] == n["future_rows"], n["future_ids"] in (-1, future_len),
            _sample_lengths_agree(n)]
    need += [n[k] == b for k in ("rows", "row_epochs", "reset", "starts")]
    if all(need):
        need += [n["slots"] == int((seq - starts).sum()),
                 n["full"] in (-1, int(seq.sum())), got["kv_indptr"][-1] == seq.sum(),
                 _sample_rows_in_range(got, n["logits_indices"])]
    if not all(need):
        raise PlanFrameError(f"step frame {step}: its arrays' lengths disagree ({n})")


def _sample_rows_in_range(got: dict[str, np.ndarray | None], logit_rows: int) -> bool:
    """The spec's rows name logits rows of this plan, and its random rows name spec rows: an
    index past either would make the last stage send fewer ids than rank 0 waits for (a hang
    on NCCL) or index out of bounds on the device."""
    rows, ints, ship = got["sample_rows"], got["sample_ints"], got["sample_ship"]
    if rows is None:
        return True
    inside = [a for a in (rows, ship) if a is not None and len(a)]
    if any(int(a.min()) < 0 or int(a.max()) >= logit_rows for a in inside):
        return False
    items = None if ints is None or not len(ints) else ints.reshape(-1, 4)[:, 0]
    return items is None or (int(items.min()) >= 0 and int(items.max()) < len(rows))


def _sample_lengths_agree(n: dict[str, int]) -> bool:
    """A step's `SampleSpec` arrays: none without rows; ints [k, 4] and floats [k, 3] both or
    neither."""
    rows, ints, floats = n["sample_rows"], n["sample_ints"], n["sample_floats"]
    if rows < 0:
        return ints == floats == n["sample_ship"] == -1
    return ints == floats == -1 or (ints >= 0 and ints % 4 == 0 and 4 * floats == 3 * ints)


def _ranges(begin: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Concatenated aranges [begin[i], end[i]) without a Python loop."""
    lens = end - begin
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.int64)
    offsets = np.repeat(begin - np.cumsum(lens) + lens, lens)
    return np.arange(total, dtype=np.int64) + offsets
