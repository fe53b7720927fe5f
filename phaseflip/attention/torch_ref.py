"""Reference attention over the paged KV pool, in plain torch.

It is the test oracle for every faster backend and the CPU path: one sequence at a time,
gather the sequence's slots (dequantized from an FP8 pool), causal softmax in float32.
"""

from __future__ import annotations

import torch

from phaseflip.cache.kv_pool import KVPool
from phaseflip.forward_batch import ForwardBatch
from phaseflip.kernels.gemm_rows import empty_rows


class TorchRefAttention:
    name = "torch"
    graph_capturable = False  # reads kv_indptr on the host every layer

    def bind_graph_batch(self, batch: ForwardBatch, max_kv_len: int) -> object:
        raise NotImplementedError("the reference attention cannot be captured in a CUDA graph")

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        scale: float,
        sliding_window: int | None = None,
        *,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens, stored at `out_cache_loc` here
        unless `kv_stored` (already in the pool). Returns [T, H*D] in q's dtype."""
        if not kv_stored:
            pool.store(layer_id, batch.out_cache_loc, k, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        group = num_heads // k.shape[1]
        # rows padded for the o projection's GEMM, as the Triton backend's (`gemm_rows`)
        out = empty_rows(q.shape[0], num_heads * head_dim, q.dtype, q.device, fp8=False)
        indptr = batch.kv_indptr.tolist()
        start = 0
        for i, (ext, pre) in enumerate(zip(batch.extend_lens, batch.prefix_lens)):
            slots = batch.kv_indices[indptr[i] : indptr[i + 1]]
            kk, vv = pool.dequantized(layer_id, slots)  # float32 [S, KVH, D] (FP8: scaled)
            kk = kk.repeat_interleave(group, dim=1)  # [S, H, D]
            vv = vv.repeat_interleave(group, dim=1)
            qq = q[start : start + ext].float()  # [E, H, D]
            scores = torch.einsum("ehd,shd->hes", qq, kk) * scale
            q_pos = torch.arange(pre, pre + ext, device=q.device)[:, None]
            k_pos = torch.arange(slots.numel(), device=q.device)[None, :]
            masked = k_pos > q_pos
            if sliding_window is not None:
                masked |= k_pos <= q_pos - sliding_window
            scores.masked_fill_(masked, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            o = torch.einsum("hes,shd->ehd", probs, vv)
            out[start : start + ext] = o.reshape(ext, -1).to(q.dtype)
            start += ext
        return out
