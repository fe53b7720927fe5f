"""Attention backends over the paged KV pool. `torch_ref` is the oracle; others must match it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    name: str

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """Stores the new K/V at `batch.out_cache_loc`, returns attention output [T, H*D]."""
        ...
