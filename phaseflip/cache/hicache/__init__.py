"""Hierarchical KV cache storage: content-addressed, layout-free pages in host and disk tiers.

`page` defines the keys (hash chain of token ids, salted by the model fingerprint) and the
canonical page format; `frames` the host memory (private pinned, or shared by a node's ranks);
`host_pool` the host tier's index; `disk_store` the disk tier; `transfer` the per-rank executor
of device<->host copies; `disk_io` the disk threads. The scheduler-side controller (policies,
prefetch, the one decider of every transfer) builds on these.
"""

from __future__ import annotations

from phaseflip.cache.hicache.disk_store import DiskPageStore
from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.host_pool import HostPagePool
from phaseflip.cache.hicache.page import (
    CorruptPageError,
    ForeignPageError,
    PageGeometry,
    PageHeader,
    PageStore,
    StoreStats,
    decode_page,
    decode_slice,
    encode_page,
    encode_page_into,
    model_fingerprint,
    page_header,
    page_keys,
    parse_header,
    payload_tensor,
    root_key,
    slice_offsets,
    verify_page,
)
from phaseflip.cache.hicache.transfer import (
    KVTransferEngine,
    RankSlice,
    TransferOrders,
    gather_page,
    rank_slice,
    scatter_page,
)

__all__ = [
    "CorruptPageError",
    "DiskPageStore",
    "ForeignPageError",
    "HostFrames",
    "HostPagePool",
    "KVTransferEngine",
    "PageGeometry",
    "PageHeader",
    "PageStore",
    "RankSlice",
    "StoreStats",
    "TransferOrders",
    "decode_page",
    "decode_slice",
    "encode_page",
    "encode_page_into",
    "gather_page",
    "model_fingerprint",
    "page_header",
    "page_keys",
    "parse_header",
    "payload_tensor",
    "rank_slice",
    "root_key",
    "scatter_page",
    "slice_offsets",
    "verify_page",
]
