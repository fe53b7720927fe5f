"""Attention backends over the paged KV pool. `torch_ref` is the oracle; others must match it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    name: str
    graph_capturable: bool
    """Whether decode forwards may be captured in a CUDA graph (no host reads per layer)."""

    def bind_graph_batch(self, batch: ForwardBatch, max_kv_len: int) -> object:
        """Capture hook: prepares `batch` (static graph buffers) for any context up to
        `max_kv_len`; returns state the caller keeps alive with the graph."""
        ...

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, scale: float,
                sliding_window: int | None = None, *, kv_stored: bool = False) -> torch.Tensor:
        """Stores the new K/V at `batch.out_cache_loc` (unless `kv_stored`: the caller already
        wrote them, e.g. fused with rotary), returns attention output [T, H*D]."""
        ...
