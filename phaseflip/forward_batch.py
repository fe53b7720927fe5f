"""The forward plan: everything one model forward needs, as plain tensors and counts.

Built by the scheduler (the one decider), executed verbatim by the model runner. Sequences are
laid out back to back: sequence `i` contributes `extend_lens[i]` new tokens (its queries) and
attends to `kv_indptr[i+1] - kv_indptr[i]` slots (its cached prefix followed by the new tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T] new tokens of every sequence, concatenated
    positions: torch.Tensor  # int64 [T]
    out_cache_loc: torch.Tensor  # int64 [T] slot each new token's K/V is written to
    extend_lens: list[int]  # new tokens per sequence
    prefix_lens: list[int]  # tokens per sequence already in the KV pool before this forward
    kv_indptr: torch.Tensor  # int64 [B+1] offsets into kv_indices
    kv_indices: torch.Tensor  # int64 [sum seq_lens] slots of each sequence's whole context
    logits_indices: torch.Tensor  # int64 [L] rows of the hidden states whose logits are needed
    max_position: int  # largest entry of `positions` (known on the host, so no device sync)

    @classmethod
    def from_table(
        cls, table: torch.Tensor, rows: Sequence[int], prefix_lens: list[int],
        extend_lens: list[int], input_ids: list[int], logits_indices: list[int],
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
        return cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.from_numpy(positions),
            out_cache_loc=torch.from_numpy(out_cache_loc),
            extend_lens=list(extend_lens),
            prefix_lens=list(prefix_lens),
            kv_indptr=torch.from_numpy(indptr),
            kv_indices=torch.from_numpy(kv_indices),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            max_position=int(seq.max()) - 1 if len(row) else -1,
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
        """Cuts the batch into up to `parts` micro-batches of whole sequences (for pipeline
        parallelism); concatenating their logits gives this batch's logits, in order."""
        parts = max(1, min(parts, self.batch_size))
        if parts == 1:
            return [self]
        bounds = [round(i * self.batch_size / parts) for i in range(parts + 1)]
        tok = [0]
        for n in self.extend_lens:
            tok.append(tok[-1] + n)
        out = []
        for a, b in zip(bounds, bounds[1:]):
            t0, t1 = tok[a], tok[b]
            k0, k1 = int(self.kv_indptr[a]), int(self.kv_indptr[b])
            li = self.logits_indices
            sel = li[(li >= t0) & (li < t1)] - t0
            out.append(ForwardBatch(
                input_ids=self.input_ids[t0:t1], positions=self.positions[t0:t1],
                out_cache_loc=self.out_cache_loc[t0:t1], extend_lens=self.extend_lens[a:b],
                prefix_lens=self.prefix_lens[a:b], kv_indptr=self.kv_indptr[a:b + 1] - k0,
                kv_indices=self.kv_indices[k0:k1], logits_indices=sel,
                max_position=int(self.positions[t0:t1].max()),
            ))
        return out

    def to(self, device: torch.device | str) -> ForwardBatch:
        move = {
            k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
            for k, v in self.__dict__.items()
        }
        return ForwardBatch(**move)
