"""The forward plan: everything one model forward needs, as plain tensors and counts.

Built by the scheduler (the one decider), executed verbatim by the model runner. Sequences are
laid out back to back: sequence `i` contributes `extend_lens[i]` new tokens (its queries) and
attends to `kv_indptr[i+1] - kv_indptr[i]` slots (its cached prefix followed by the new tokens).
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T] new tokens of every sequence, concatenated
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T] slot each new token's K/V is written to
    extend_lens: list[int]  # new tokens per sequence (each >= 1)
    prefix_lens: list[int]  # tokens per sequence already in the KV pool before this forward
    kv_indptr: torch.Tensor  # int64 [B+1] offsets into kv_indices
    kv_indices: torch.Tensor  # int64 [sum seq_lens] slots of each sequence's whole context
    logits_indices: torch.Tensor  # int64 [L] ascending rows of the hidden states to take logits of
    max_position: int  # largest entry of `positions` (known on the host, so no device sync)
    # request-table rows of the sequences and their epochs (`ReqToTokenTable.epochs`), when
    # the plan came from the table: what lets other ranks receive only new slots
    rows: np.ndarray | None = None
    row_epochs: np.ndarray | None = None
    delta: object | None = None  # on the wire to other ranks: `plan_codec.PlanDelta`
    # placeholders (overlap scheduling), known on the host: positions in `input_ids` holding
    # -1 - r and their rows r of the previous step's sampled tokens; None when not worked out
    future_pos: np.ndarray | None = None
    future_rows: np.ndarray | None = None

    @classmethod
    def from_table(
        cls, table: torch.Tensor, rows: Sequence[int], prefix_lens: list[int],
        extend_lens: list[int], input_ids: list[int], logits_indices: list[int],
        epochs: np.ndarray | None = None,
    ) -> ForwardBatch:
        """The plan for sequences whose slots are listed in the request→token `table` (host
        int64 [R, C]): row `rows[i]` holds the slots of sequence i's tokens [0, prefix_lens[i]
        + extend_lens[i]). Every tensor is a fresh copy, never a view of `table`.

        Why here and vectorised: built sequence by sequence (an arange and two table slices
        each, then three `torch.cat` of B pieces) a plan costs ~10 us a sequence, most of a
        decode step's scheduling at 256 requests; in numpy it is a few ops whatever B."""
        t = table.numpy()
        row = np.asarray(rows, dtype=np.int64)
        pre = np.asarray(prefix_lens, dtype=np.int64)
        ext = np.asarray(extend_lens, dtype=np.int64)
        seq = pre + ext
        indptr = np.zeros(len(row) + 1, dtype=np.int64)
        np.cumsum(seq, out=indptr[1:])
        if bool((ext == 1).all()):  # a decode step: one token per sequence
            positions = pre
            out_cache_loc = t[row, pre]
        else:
            starts = np.cumsum(ext) - ext  # each sequence's first token in the batch
            positions = np.arange(int(ext.sum()), dtype=np.int64) - np.repeat(starts - pre, ext)
            out_cache_loc = t[np.repeat(row, ext), positions]
        views = [t[r, :n] for r, n in zip(rows, seq.tolist())]
        kv_indices = np.concatenate(views) if views else np.empty(0, dtype=np.int64)
        ids = np.asarray(input_ids, dtype=np.int64)
        future_pos = np.flatnonzero(ids < 0)
        return cls(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            out_cache_loc=torch.from_numpy(out_cache_loc),
            extend_lens=list(extend_lens),
            prefix_lens=list(prefix_lens),
            kv_indptr=torch.from_numpy(indptr),
            kv_indices=torch.from_numpy(kv_indices),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            max_position=int(seq.max()) - 1 if len(row) else -1,
            rows=row, row_epochs=epochs[row] if epochs is not None else None,
            future_pos=future_pos, future_rows=-1 - ids[future_pos],
        )

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def split(self, parts: int) -> list[ForwardBatch]:
        """Cuts the batch into `min(parts, num_tokens)` micro-batches of about equal token
        counts, none empty (pipeline parallelism: a long prompt alone must still pipeline).

        A sequence whose new tokens straddle a cut becomes one piece per micro-batch: the piece
        of its new tokens [a, b) has prefix `prefix_lens[i] + a`, extend `b - a` and the first
        `prefix_lens[i] + b` slots of the sequence's context. Sound because each stage runs its
        micro-batches in order, so its layers have written the K/V of the earlier pieces before
        a later piece attends to them as cached prefix. As sequences lie back to back, a
        micro-batch's slots are one contiguous range of `kv_indices` (a view).

        Logits rows go with their tokens, re-based; as `logits_indices` ascend, concatenating
        the parts' logits gives this batch's logits in order. A decode batch (one token per
        sequence) is cut between sequences exactly as before token cuts existed."""
        total = self.num_tokens
        parts = max(1, min(parts, total))
        if parts == 1:
            return [self]
        # round, not floor, keeps the decode cuts of the sequence-only split; with
        # parts <= total consecutive cuts still differ by at least one token
        cuts = [round(k * total / parts) for k in range(parts + 1)]
        ends = list(accumulate(self.extend_lens))  # token end of each sequence in the batch
        indptr = self.kv_indptr.tolist()
        li = self.logits_indices
        rows = torch.searchsorted(li, torch.tensor(cuts, device=li.device)).tolist()  # per cut
        return [self._piece(t0, t1, ends, indptr, rows[k], rows[k + 1])
                for k, (t0, t1) in enumerate(zip(cuts, cuts[1:]))]

    def _piece(self, t0: int, t1: int, ends: list[int], indptr: list[int], r0: int,
               r1: int) -> ForwardBatch:
        """Tokens [t0, t1) as a batch (see `split`); r0:r1 are their logits rows."""
        first, last = bisect_right(ends, t0), bisect_left(ends, t1)  # sequences [first, last]
        a = t0 - (ends[first] - self.extend_lens[first])  # cut inside the first sequence
        b = t1 - (ends[last] - self.extend_lens[last])  # end inside the last sequence
        extend = self.extend_lens[first : last + 1]
        prefix = self.prefix_lens[first : last + 1]
        extend[-1] = b
        extend[0] -= a
        prefix[0] += a
        k0, k1 = indptr[first], indptr[last] + self.prefix_lens[last] + b
        kv_indptr = self.kv_indptr[first : last + 2] - k0
        kv_indptr[-1] = k1 - k0
        positions = self.positions[t0:t1]
        return ForwardBatch(
            input_ids=self.input_ids[t0:t1], positions=positions,
            out_cache_loc=self.out_cache_loc[t0:t1], extend_lens=extend, prefix_lens=prefix,
            kv_indptr=kv_indptr, kv_indices=self.kv_indices[k0:k1],
            logits_indices=self.logits_indices[r0:r1] - t0, max_position=int(positions.max()),
        )

    def with_future_tokens(self, future: torch.Tensor) -> ForwardBatch:
        """Resolves placeholder ids (-1 - r: row r of the previous step's sampled tokens, still
        on the device) in `input_ids`; the batch must already be on `future`'s device."""
        if future.numel() == 0:
            return self
        if self.future_pos is None:  # not worked out on the host: resolve on the device
            ids = self.input_ids
            rows = (-ids - 1).clamp_min(0)
            return dataclasses.replace(self, input_ids=torch.where(ids < 0, future[rows], ids))
        ids = self.input_ids.clone()
        self.fill_future(ids, future)
        return dataclasses.replace(self, input_ids=ids)

    def fill_future(self, ids: torch.Tensor, future: torch.Tensor) -> None:
        """Writes the placeholders' tokens from `future` into `ids` (this plan's ids, on
        `future`'s device), decided from the host-side `future_pos`/`future_rows`. The usual
        decode step (every id a placeholder, rows in order) is one device copy; the indices of
        any other pattern travel in one small pinned copy. No host sync either way."""
        pos, rows = self.future_pos, self.future_rows
        n = 0 if pos is None else len(pos)
        if n == 0:
            return
        if n == ids.numel() and bool((rows == np.arange(n)).all()):  # ids = rows 0..n-1
            ids.copy_(future[:n])
            return
        idx = torch.from_numpy(np.concatenate([pos, rows]))
        if ids.is_cuda:
            idx = idx.pin_memory().to(ids.device, non_blocking=True)
        ids[idx[:n]] = future[idx[n:]]

    def pinned(self) -> ForwardBatch:
        """The plan with its host tensors in pinned memory (device tensors as they are). A
        non-blocking copy to the GPU from pageable memory may wait for the stream's earlier
        kernels (its staging buffer drains in stream order), which would tie an overlapped
        step's launch to the end of the step before it; from pinned memory it does not."""
        def pin(v: torch.Tensor) -> torch.Tensor:
            return v.pin_memory() if v.device.type == "cpu" and not v.is_pinned() else v

        return ForwardBatch(**{k: pin(v) if isinstance(v, torch.Tensor) else v
                               for k, v in self.__dict__.items()})

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The plan on `device` (through pinned memory when bound for a GPU)."""
        device = torch.device(device)
        src = self.pinned() if device.type == "cuda" else self
        return ForwardBatch(**{k: v.to(device, non_blocking=True)
                               if isinstance(v, torch.Tensor) else v
                               for k, v in src.__dict__.items()})
