"""Content-addressed page keys and the canonical, layout-free page format of the HiCache tiers.

A *page* is the K and V of `page_size` consecutive tokens for every layer and every KV head, so
a prefix written under one TP/PP geometry can be read back under any other: a TP rank reads its
head slice, a PP stage its layer slice. Its key is a hash chain over the token ids, so equal
prefixes get equal keys across requests, restarts and processes without any shared index.

Encoded page (all header integers little-endian; see `_FIXED`):

    off  size  field
      0     8  magic b"PFKVPAGE"
      8     2  format version (u16, = 1)
     10     1  dtype code (u8, `_DTYPE_CODES`)
     11     1  flags (u8): 0 = sealed; FLAG_UNSEALED = a host-tier frame without checksums
     12    16  page_size, num_layers, num_kv_heads, head_dim (u32 each)
     28     4  header crc32 of bytes [0, payload_offset) with this field zeroed (0 if unsealed)
     32    16  model fingerprint
     48     8  payload length in bytes (u64)
     56     4  payload offset (u32): 64 + 4 * 2*L*H rounded up to 64
     60     4  reserved, 0
     64  8L*H  block checksum table: crc32 (u32) of block b = (layer*2 + k|v)*H + head
       ...     zero padding up to payload_offset
    payload    [layer][k|v][kv_head][token][head_dim], elements in little-endian byte order

Two states of one layout. The host tier holds pages *unsealed*: header fields written, no
checksums (host RAM is not a corruption domain we guard, and a per-block CRC on every store cost
more than the copy itself). A page is *sealed* (`page_header(..., payload)`: checksum table and
header crc filled, flags 0) only on its way to the disk tier, and verified on its way back; the
payload bytes never move, so a host frame is written to disk as header + payload as it is.
`parse_header` refuses an unsealed page: nothing unverified is ever read from disk.

Checksums are per *block* = (layer, k|v, head), the smallest unit any geometry reads (token and
head_dim are innermost, so every TP/PP slice is a union of whole blocks). A ranged reader can thus
verify exactly the bytes it read; a whole-payload checksum could not be checked by a slice reader.
The header crc covers the table, so a corrupt fingerprint or geometry is "corrupt", not "foreign".

Byte-range map (`slice_offsets`; adjacent ranges are merged): the whole page and every PP slice
(a layer range, all heads) are ONE range covering K and V of all its layers; a TP slice (a proper
head subrange) is 2 ranges per layer (its K heads, its V heads), so a TP x PP slice is
2 * len(layers) ranges. With a single KV head (MQA) a TP slice is all heads, hence contiguous.
The same map is used by the ranks of a TP/PP group writing and reading their slices of a shared
host frame (`transfer.py`) and by ranged disk reads.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
import zlib
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

import torch

from phaseflip.errors import PhaseflipError

Buffer = bytes | bytearray | memoryview

MAGIC = b"PFKVPAGE"
FORMAT_VERSION = 1
HEADER_FIXED_SIZE = 64
KEY_BYTES = 16
_ALIGN = 64
_FIXED = struct.Struct("<8sHBBIIIII16sQII")
_CRC_OFFSET = 28
FLAG_UNSEALED = 1
assert _FIXED.size == HEADER_FIXED_SIZE

# Codes are part of the on-disk format: never renumber, only append.
_DTYPE_CODES: Mapping[torch.dtype, int] = MappingProxyType({
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.float8_e4m3fn: 5,
    torch.float8_e5m2: 6,
})
_CODE_DTYPES = MappingProxyType({code: dtype for dtype, code in _DTYPE_CODES.items()})
# A corrupt header could claim billions of blocks; no real model has a table this large.
_MAX_BLOCKS = 1 << 22

# config.json keys that cannot change the KV of a given token sequence. Everything else is hashed:
# an unknown key costs at worst a cache miss, while a wrongly ignored one would serve wrong KV.
_FINGERPRINT_IGNORED_KEYS = frozenset({
    "transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "attention_dropout",
    "output_attentions", "output_hidden_states", "return_dict",
})


class CorruptPageError(PhaseflipError):
    """An encoded page failed validation; a store must treat it as a miss, never as data."""


class ForeignPageError(CorruptPageError):
    """A well-formed page of another model (fingerprint); stores ignore it rather than delete."""


# ---------------------------------------------------------------- keys and fingerprints


def model_fingerprint(
    config_json: Mapping[str, Any], dtype: str | torch.dtype, *, weights_id: bytes = b""
) -> bytes:
    """16-byte identity of "the KV this model produces": architecture fields + KV dtype.

    The config does not identify the *weights*: two fine-tunes of one architecture share a
    config, so serving both from one store needs `weights_id` (e.g. a checkpoint digest or a
    revision string); without it they would read each other's KV.
    """
    fields = {k: v for k, v in config_json.items() if k not in _FINGERPRINT_IGNORED_KEYS}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"phaseflip-model")
    for part in (b"v1", canonical.encode(), _dtype_name(dtype).encode(), weights_id):
        h.update(struct.pack("<Q", len(part)) + part)  # length-prefixed: no ambiguous joins
    return h.digest()


def root_key(salt: bytes, page_size: int) -> bytes:
    """key_{-1} of the chain. page_size is mixed in so geometries never share a key space."""
    return hashlib.blake2b(salt + struct.pack("<I", page_size), digest_size=KEY_BYTES).digest()


def page_keys(
    token_ids: Sequence[int], page_size: int, salt: bytes, *, parent: bytes | None = None
) -> list[bytes]:
    """One key per FULL page: key_i = blake2b16(key_{i-1} || u32le token ids of page i).

    `parent` is the key of the page just before `token_ids[0]` (which must then start a page),
    so a growing sequence is hashed incrementally; by default the chain starts at `root_key`.
    A trailing partial page gets no key: its content is not final.
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    n = len(token_ids) // page_size * page_size
    try:
        packed = memoryview(struct.pack(f"<{n}I", *token_ids[:n]))
    except struct.error as exc:
        raise ValueError(f"token ids must fit in u32: {exc}") from exc
    key = root_key(salt, page_size) if parent is None else parent
    step = 4 * page_size
    keys = []
    for off in range(0, len(packed), step):
        h = hashlib.blake2b(key, digest_size=KEY_BYTES)
        h.update(packed[off : off + step])
        key = h.digest()
        keys.append(key)
    return keys


def _dtype_name(dtype: str | torch.dtype) -> str:
    """Canonical name, so "half", "float16", "torch.float16" and torch.float16 hash alike."""
    if isinstance(dtype, str):
        dtype = dtype.removeprefix("torch.")
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return str(resolved).removeprefix("torch.")


# ---------------------------------------------------------------- header


@dataclass(frozen=True)
class PageGeometry:
    """Shape of a page; offsets below are absolute (from the first byte of the encoded page).

    A reader knows its model, so it can build this and plan ranged reads before reading a byte.
    """

    dtype: torch.dtype
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_bytes(self) -> int:
        return self.page_size * self.head_dim * self.dtype.itemsize

    @property
    def payload_offset(self) -> int:
        return _payload_offset(self.num_layers, self.num_kv_heads)

    @property
    def payload_len(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_bytes

    @property
    def total_size(self) -> int:
        """Encoded size of one page: what a host frame or a file of this geometry holds."""
        return self.payload_offset + self.payload_len

    def block_offset(self, layer: int, kv: int, head: int) -> int:
        block = (layer * 2 + kv) * self.num_kv_heads + head
        return self.payload_offset + block * self.block_bytes


@dataclass(frozen=True)
class PageHeader(PageGeometry):
    """A header whose magic, version, crc and lengths have been validated."""

    fingerprint: bytes = b""
    block_crcs: tuple[int, ...] = ()  # index (layer*2 + k|v)*num_kv_heads + head


def _payload_offset(num_layers: int, num_kv_heads: int) -> int:
    raw = HEADER_FIXED_SIZE + 4 * 2 * num_layers * num_kv_heads  # fixed part + crc table
    return -(-raw // _ALIGN) * _ALIGN


def header_length(fixed: Buffer) -> int:
    """Bytes of the full header (fixed part + table + padding), from its first 64 bytes."""
    fixed = memoryview(fixed)
    if len(fixed) < HEADER_FIXED_SIZE:
        raise CorruptPageError(f"truncated page: {len(fixed)} header bytes")
    if bytes(fixed[:8]) != MAGIC:
        raise CorruptPageError("bad magic: not a phaseflip KV page")
    fields = _FIXED.unpack_from(fixed)
    if fields[1] != FORMAT_VERSION:
        raise CorruptPageError(f"unsupported page format version {fields[1]}")
    # Geometry is not yet covered by the header crc (parse_header checks it): bound it so a
    # corrupt header cannot make a reader allocate or read an absurd amount.
    if not 0 < 2 * fields[5] * fields[6] <= _MAX_BLOCKS:
        raise CorruptPageError("page header has an absurd geometry")
    return _payload_offset(fields[5], fields[6])


def parse_header(buf: Buffer, fingerprint: bytes | None = None) -> PageHeader:
    """Validate the header in `buf` (at least `header_length` bytes) and return it.

    Raises CorruptPageError on bad magic/version/crc/geometry and ForeignPageError when the
    header is intact but the fingerprint is not `fingerprint` (another model's page).
    """
    mv = memoryview(buf).cast("B")
    hlen = header_length(mv)
    if len(mv) < hlen:
        raise CorruptPageError(f"truncated page: {len(mv)} of {hlen} header bytes")
    (_, _, code, res1, page_size, layers, heads, head_dim, crc, fp, payload_len, payload_off,
     res2) = _FIXED.unpack_from(mv)
    if res1 == FLAG_UNSEALED and crc == 0:
        raise CorruptPageError("unsealed (host-tier) page: it carries no checksums")
    scratch = bytearray(mv[:hlen])
    struct.pack_into("<I", scratch, _CRC_OFFSET, 0)
    if zlib.crc32(scratch) != crc:
        raise CorruptPageError("page header checksum mismatch")
    if code not in _CODE_DTYPES or res1 or res2 or min(page_size, layers, heads, head_dim) < 1:
        raise CorruptPageError("page header has an invalid dtype or geometry")
    nblocks = 2 * layers * heads
    header = PageHeader(
        dtype=_CODE_DTYPES[code], page_size=page_size, num_layers=layers, num_kv_heads=heads,
        head_dim=head_dim, fingerprint=fp,
        block_crcs=struct.unpack_from(f"<{nblocks}I", mv, HEADER_FIXED_SIZE),
    )
    if payload_off != header.payload_offset or payload_len != header.payload_len:
        raise CorruptPageError("page header lengths disagree with its geometry")
    if fingerprint is not None and fp != fingerprint:
        raise ForeignPageError(f"page of another model (fingerprint {fp.hex()})")
    return header


# ---------------------------------------------------------------- encode


def page_header(geometry: PageGeometry, fingerprint: bytes, payload: Buffer | None = None
                ) -> bytes:
    """The `payload_offset` header bytes of a page of `geometry`.

    With `payload` (its `payload_len` bytes) the header is *sealed*: block checksums and header
    crc filled, what the disk tier stores. Without, it is *unsealed* (FLAG_UNSEALED, no
    checksums): what a host frame carries, written once per store at no cost.
    """
    if geometry.dtype not in _DTYPE_CODES:
        raise ValueError(f"unsupported KV dtype {geometry.dtype}")
    if len(fingerprint) != KEY_BYTES:
        raise ValueError(f"fingerprint must be {KEY_BYTES} bytes")
    if sys.byteorder != "little":
        raise RuntimeError("the page format is little-endian; big-endian hosts are unsupported")
    g, off = geometry, geometry.payload_offset
    out = bytearray(off)
    sealed = payload is not None
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, _DTYPE_CODES[g.dtype],
                     0 if sealed else FLAG_UNSEALED, g.page_size, g.num_layers, g.num_kv_heads,
                     g.head_dim, 0, fingerprint, g.payload_len, off, 0)
    if sealed:
        mv = memoryview(payload).cast("B")
        if len(mv) != g.payload_len:
            raise ValueError(f"payload is {len(mv)} bytes, the geometry says {g.payload_len}")
        bb = g.block_bytes
        crcs = [zlib.crc32(mv[p : p + bb]) for p in range(0, len(mv), bb)]
        struct.pack_into(f"<{len(crcs)}I", out, HEADER_FIXED_SIZE, *crcs)
        struct.pack_into("<I", out, _CRC_OFFSET, zlib.crc32(out))
    return bytes(out)


def payload_tensor(frame: torch.Tensor, geometry: PageGeometry) -> torch.Tensor:
    """The payload of the page in `frame` (a 1-D uint8 CPU tensor starting at the page's first
    byte) as a `[L, 2, H, P, D]` tensor view: index [layer, k|v, head, token, dim]."""
    g = geometry
    if frame.dtype != torch.uint8 or frame.dim() != 1 or len(frame) < g.total_size:
        raise ValueError(f"frame must be a 1-D uint8 buffer of >= {g.total_size} bytes")
    raw = frame[g.payload_offset : g.total_size]
    return raw.view(g.dtype).view(g.num_layers, 2, g.num_kv_heads, g.page_size, g.head_dim)


def _kv_geometry(k: torch.Tensor, v: torch.Tensor) -> PageGeometry:
    if k.shape != v.shape or k.dim() != 4 or k.dtype != v.dtype:
        raise ValueError(f"k/v must be equal [L, H, P, D] tensors, got {k.shape} / {v.shape}")
    layers, heads, page_size, head_dim = k.shape
    return PageGeometry(k.dtype, page_size, layers, heads, head_dim)


def encode_page_into(
    k: torch.Tensor, v: torch.Tensor, fingerprint: bytes, out: torch.Tensor | bytearray, *,
    sealed: bool = True,
) -> int:
    """Encode K, V `[L, H, P, D]` into `out` (uint8 CPU tensor, e.g. a pinned host frame, or a
    bytearray) and return the encoded length. The payload is copied straight into `out`, so a
    device-resident K/V costs exactly one device->host copy; `sealed=False` writes a host-tier
    page (no checksums)."""
    geometry = _kv_geometry(k, v)
    total = geometry.total_size
    dst = torch.frombuffer(out, dtype=torch.uint8) if isinstance(out, bytearray) else out
    if dst.dtype != torch.uint8 or dst.dim() != 1 or dst.device.type != "cpu" or len(dst) < total:
        raise ValueError(f"out must be a 1-D uint8 CPU buffer of >= {total} bytes")
    payload = payload_tensor(dst, geometry)
    payload[:, 0].copy_(k)
    payload[:, 1].copy_(v)
    mv = memoryview(dst.numpy()).cast("B")
    off = geometry.payload_offset
    mv[:off] = page_header(geometry, fingerprint, mv[off:total] if sealed else None)
    return total


def encode_page(k: torch.Tensor, v: torch.Tensor, fingerprint: bytes) -> bytes:
    """Encode K, V `[L, H, P, D]` (every layer, every KV head of one page) to bytes."""
    layers, heads, page_size, head_dim = k.shape
    out = bytearray(PageGeometry(k.dtype, page_size, layers, heads, head_dim).total_size)
    encode_page_into(k, v, fingerprint, out)
    return bytes(out)


# ---------------------------------------------------------------- decode


def checked_range(r: range | None, n: int, what: str) -> range:
    """`r` (default: all of range(n)) after checking it is a non-empty step-1 subrange."""
    if r is None:
        return range(n)
    if r.step != 1 or not 0 <= r.start < r.stop <= n:
        raise ValueError(f"{what} {r} is not a non-empty step-1 subrange of range({n})")
    return r


def _runs(header: PageGeometry, layers: range, heads: range) -> list[tuple[int, int, int]]:
    """(layer, k|v, absolute offset) of each per-(layer, k|v) run of the requested heads."""
    return [(la, kv, header.block_offset(la, kv, heads.start)) for la in layers for kv in (0, 1)]


def slice_offsets(
    header: PageGeometry, layers: range | None = None, heads: range | None = None
) -> list[tuple[int, int]]:
    """Sorted, merged absolute (offset, length) byte ranges a reader of this slice needs."""
    layers = checked_range(layers, header.num_layers, "layers")
    heads = checked_range(heads, header.num_kv_heads, "heads")
    run = len(heads) * header.block_bytes
    merged: list[tuple[int, int]] = []
    for _, _, off in _runs(header, layers, heads):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + run)
        else:
            merged.append((off, run))
    return merged


def verify_chunks(
    header: PageHeader, ranges: Sequence[tuple[int, int]], chunks: Sequence[Buffer]
) -> list[memoryview]:
    """Check each chunk against the checksums of the blocks it covers; return them as views.

    Ranges must be block-aligned and inside the payload (as `slice_offsets` makes them).
    """
    if len(chunks) != len(ranges):
        raise ValueError(f"{len(chunks)} chunks for {len(ranges)} ranges")
    bb, start, end = header.block_bytes, header.payload_offset, header.total_size
    views = [memoryview(c).cast("B") for c in chunks]
    for (off, length), view in zip(ranges, views):
        if (off - start) % bb or length % bb or off < start or off + length > end:
            raise ValueError(f"range ({off}, {length}) is not a block-aligned payload range")
        if len(view) != length:
            raise CorruptPageError(f"truncated page: {len(view)} of {length} bytes at {off}")
        first = (off - start) // bb
        for j in range(length // bb):
            if zlib.crc32(view[j * bb : (j + 1) * bb]) != header.block_crcs[first + j]:
                raise CorruptPageError(f"checksum mismatch in block {first + j}")
    return views


def decode_slice(
    header: PageHeader, chunks: Sequence[Buffer], *, layers: range | None = None,
    heads: range | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[len(layers), len(heads), P, D]` from the bytes of `slice_offsets(header, ...)`.

    `chunks[i]` holds range i; every block read is verified against its checksum. The result
    owns its memory (never aliases `chunks`), so a host frame may be reused right after.
    """
    layers = checked_range(layers, header.num_layers, "layers")
    heads = checked_range(heads, header.num_kv_heads, "heads")
    ranges = slice_offsets(header, layers, heads)
    views = verify_chunks(header, ranges, chunks)
    starts = [off for off, _ in ranges]
    shape = (len(layers), len(heads), header.page_size, header.head_dim)
    k, v = torch.empty(shape, dtype=header.dtype), torch.empty(shape, dtype=header.dtype)
    dsts = [memoryview(t.view(torch.uint8).numpy()).cast("B") for t in (k, v)]
    run = len(heads) * header.block_bytes
    for la, kv, off in _runs(header, layers, heads):
        i = bisect_right(starts, off) - 1  # every run lies inside one merged range
        dst = (la - layers.start) * run
        dsts[kv][dst : dst + run] = views[i][off - starts[i] : off - starts[i] + run]
    return k, v


def decode_page(
    buf: Buffer, fingerprint: bytes, *, layers: range | None = None, heads: range | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[len(layers), len(heads), P, D]` of a whole encoded page; raises CorruptPageError
    (ForeignPageError for another model's page) instead of ever returning unverified data."""
    mv, header = _parse_whole(buf, fingerprint)
    chunks = [mv[off : off + n] for off, n in slice_offsets(header, layers, heads)]
    return decode_slice(header, chunks, layers=layers, heads=heads)


def verify_page(buf: Buffer, fingerprint: bytes) -> PageHeader:
    """Validate a whole encoded page (header, length, every block) without decoding it."""
    mv, header = _parse_whole(buf, fingerprint)
    verify_chunks(header, [(header.payload_offset, header.payload_len)],
                  [mv[header.payload_offset :]])
    return header


def _parse_whole(buf: Buffer, fingerprint: bytes) -> tuple[memoryview, PageHeader]:
    mv = memoryview(buf).cast("B")
    header = parse_header(mv, fingerprint)
    if len(mv) != header.total_size:
        raise CorruptPageError(f"page is {len(mv)} bytes, header says {header.total_size}")
    return mv, header


# ---------------------------------------------------------------- store interface


@dataclass
class StoreStats:
    """Counters of one tier. `corrupt` counts pages found invalid (and dropped)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    corrupt: int = 0
    foreign: int = 0  # well-formed pages of another model seen (and left alone)
    write_failures: int = 0
    read_errors: int = 0  # pages that could not be opened or read (an OS error: a miss)


class PageStore(Protocol):
    """What the HiCache controller needs of a tier; a remote key-value store can implement it.

    Pages are content-addressed, so `put` of a present key is a no-op returning True and a value
    never changes under a key. `get` returns a verified encoded page or None (a miss, which
    includes a corrupt page the store has dropped).
    """

    def contains(self, key: bytes) -> bool: ...

    def get(self, key: bytes) -> Buffer | None: ...

    def put(self, key: bytes, page: Buffer) -> bool: ...

    def delete(self, key: bytes) -> bool: ...

    @property
    def stats(self) -> StoreStats: ...
