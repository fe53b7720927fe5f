"""Hierarchical KV cache storage: content-addressed, layout-free pages in host and disk tiers.

`page` defines the keys (hash chain of token ids, salted by the model fingerprint) and the
canonical page format; `host_pool` the pinned host tier and the device-pool gather/scatter;
`disk_store` the disk tier. The scheduler-side controller (policies, prefetch) builds on these.
"""

from __future__ import annotations

from phaseflip.cache.hicache.disk_store import DiskPageStore
from phaseflip.cache.hicache.host_pool import HostPagePool, gather_page, scatter_page
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
    page_keys,
    parse_header,
    root_key,
    slice_offsets,
    verify_page,
)

__all__ = [
    "CorruptPageError",
    "DiskPageStore",
    "ForeignPageError",
    "HostPagePool",
    "PageGeometry",
    "PageHeader",
    "PageStore",
    "StoreStats",
    "decode_page",
    "decode_slice",
    "encode_page",
    "encode_page_into",
    "gather_page",
    "model_fingerprint",
    "page_keys",
    "parse_header",
    "root_key",
    "scatter_page",
    "slice_offsets",
    "verify_page",
]
