"""HiCache page keys and the canonical page codec: round trips, geometry slices, corruption."""

from __future__ import annotations

import struct

import pytest
import torch

from phaseflip.cache.hicache import (
    CorruptPageError,
    ForeignPageError,
    decode_page,
    decode_slice,
    encode_page,
    gather_page,
    model_fingerprint,
    page_keys,
    parse_header,
    scatter_page,
    slice_offsets,
)
from phaseflip.cache.hicache.page import HEADER_FIXED_SIZE, MAGIC, header_length
from phaseflip.cache.kv_pool import KVPool
from phaseflip.layout import Layout

L, H, D, P = 4, 4, 8, 16
CONFIG = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": L,
          "num_key_value_heads": H, "head_dim": D, "hidden_size": 64, "rope_theta": 10000.0,
          "transformers_version": "5.24.0"}
FP = model_fingerprint(CONFIG, "float32")
OTHER_FP = model_fingerprint({**CONFIG, "rope_theta": 500000.0}, "float32")


def random_kv(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn((L, H, P, D), generator=g).to(dtype)
    return k, torch.randn((L, H, P, D), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip(dtype: torch.dtype) -> None:
    k, v = random_kv(dtype)
    buf = encode_page(k, v, FP)
    k2, v2 = decode_page(buf, FP)
    assert k2.dtype == dtype and torch.equal(k2, k) and torch.equal(v2, v)
    header = parse_header(buf, FP)
    assert (header.dtype, header.page_size, header.num_layers, header.num_kv_heads,
            header.head_dim) == (dtype, P, L, H, D)
    assert len(buf) == header.total_size and header.payload_offset % 64 == 0


def test_byte_layout_is_the_documented_one() -> None:
    """The payload is [layer][k|v][head][token][dim], little-endian; the header fields sit at
    their documented offsets. Pinning this keeps pages written today readable tomorrow."""
    k, v = random_kv(torch.float16)
    buf = encode_page(k, v, FP)
    magic, version, code, _, page_size, layers, heads, head_dim, _, fp, plen, poff, _ = (
        struct.unpack_from("<8sHBBIIIII16sQII", buf))
    assert (magic, version, code, page_size, layers, heads, head_dim, fp) == (
        MAGIC, 1, 2, P, L, H, D, FP)
    expected = torch.stack((k, v), dim=1).contiguous().view(torch.uint8).numpy().tobytes()
    assert plen == len(expected) and buf[poff:] == expected
    assert header_length(buf[:HEADER_FIXED_SIZE]) == poff


def _pool(seed: int = 1) -> tuple[KVPool, torch.Tensor]:
    pool = KVPool(64, (0, L), H, D, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    for i in range(L):
        pool.k[i].copy_(torch.randn(pool.k[i].shape, generator=g))
        pool.v[i].copy_(torch.randn(pool.v[i].shape, generator=g))
    slots = torch.randperm(63, generator=g)[:P] + 1  # scattered slots, never padding slot 0
    return pool, slots


GEOMETRIES = [(2, 1), (1, 2), (2, 2)]  # (tp, pp)


@pytest.mark.parametrize(("tp", "pp"), GEOMETRIES)
def test_geometry_slices(tp: int, pp: int) -> None:
    """A page written from a full pool is read back by every rank of a TP/PP/TPxPP geometry:
    whole-buffer decode, ranged decode and scatter into a sliced pool all give exactly that
    rank's slice of the original pool."""
    pool, slots = _pool()
    buf = encode_page(*gather_page(pool.k, pool.v, slots), FP)
    header = parse_header(buf[: header_length(buf[:HEADER_FIXED_SIZE])], FP)
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            layout = Layout(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp)
            layers = range(*layout.layer_range(L))
            heads = range(*layout.shard(H, "kv heads"))
            want_k = torch.stack([pool.k[i][slots][:, heads.start : heads.stop]
                                  for i in layers]).transpose(1, 2)
            want_v = torch.stack([pool.v[i][slots][:, heads.start : heads.stop]
                                  for i in layers]).transpose(1, 2)

            k, v = decode_page(buf, FP, layers=layers, heads=heads)
            assert torch.equal(k, want_k) and torch.equal(v, want_v)

            ranges = slice_offsets(header, layers, heads)
            # Contiguity: a PP slice is one range, a TP slice two (K, V) per layer.
            assert len(ranges) == (1 if tp == 1 else 2 * len(layers))
            assert sum(n for _, n in ranges) == 2 * len(layers) * len(heads) * P * D * 4
            k2, v2 = decode_slice(header, [buf[o : o + n] for o, n in ranges],
                                  layers=layers, heads=heads)
            assert torch.equal(k2, want_k) and torch.equal(v2, want_v)

            local = KVPool(64, (layers.start, layers.stop), len(heads), D, torch.float32, "cpu")
            dst = torch.arange(10, 10 + P)
            scatter_page(k2, v2, local.k, local.v, dst)
            full_k, full_v = decode_page(buf, FP)
            other = KVPool(64, (layers.start, layers.stop), len(heads), D, torch.float32, "cpu")
            scatter_page(full_k, full_v, other.k, other.v, dst, layers=layers, heads=heads)
            for j, i in enumerate(layers):
                for sliced in (local, other):
                    assert torch.equal(sliced.k[j][dst], pool.k[i][slots][:, heads.start :
                                                                          heads.stop])
                    assert torch.equal(sliced.v[j][dst], pool.v[i][slots][:, heads.start :
                                                                          heads.stop])
                    assert not sliced.k[j][:10].any() and not sliced.k[j][10 + P :].any()


def test_full_and_single_head_geometries_are_contiguous() -> None:
    header = parse_header(encode_page(*random_kv(torch.float32), FP), FP)
    assert slice_offsets(header) == [(header.payload_offset, header.payload_len)]
    assert len(slice_offsets(header, layers=range(1, 2), heads=range(1, 2))) == 2
    with pytest.raises(ValueError):
        slice_offsets(header, layers=range(2, 5))
    with pytest.raises(ValueError):
        slice_offsets(header, heads=range(0, 4, 2))


# ---------------------------------------------------------------- keys


def test_page_keys_hash_chain() -> None:
    tokens = list(range(100, 100 + 5 * P + 3))  # five full pages and a partial one
    keys = page_keys(tokens, P, FP)
    assert len(keys) == 5 and len(set(keys)) == 5 and all(len(k) == 16 for k in keys)
    assert page_keys(list(tokens), P, FP) == keys  # deterministic across calls
    changed = list(tokens)
    changed[2 * P + 7] += 1  # a token of page 2
    keys2 = page_keys(changed, P, FP)
    assert keys2[:2] == keys[:2]
    assert all(a != b for a, b in zip(keys2[2:], keys[2:]))
    assert set(page_keys(tokens, P, OTHER_FP)).isdisjoint(keys)
    assert page_keys(tokens[: P - 1], P, FP) == []
    assert page_keys(tokens[: 5 * P], P, FP) == keys  # the partial tail never mattered
    # Incremental hashing from a parent key continues the same chain.
    assert keys[:2] + page_keys(tokens[2 * P :], P, FP, parent=keys[1]) == keys
    # Equal tokens at another page size are another key space.
    assert set(page_keys(tokens, P // 2, FP)).isdisjoint(keys)
    with pytest.raises(ValueError):
        page_keys([-1] * P, P, FP)


def test_model_fingerprint() -> None:
    assert FP == model_fingerprint(dict(reversed(list(CONFIG.items()))), "float32")
    assert FP == model_fingerprint({**CONFIG, "transformers_version": "4.0"}, torch.float32)
    assert FP == model_fingerprint(CONFIG, "torch.float32")
    assert model_fingerprint(CONFIG, "half") == model_fingerprint(CONFIG, torch.float16)
    assert FP != model_fingerprint({**CONFIG, "num_hidden_layers": L + 1}, "float32")
    assert FP != model_fingerprint({**CONFIG, "some_new_field": 1}, "float32")
    assert FP != model_fingerprint(CONFIG, "bfloat16")
    assert FP != model_fingerprint(CONFIG, "float32", weights_id=b"finetune-2")
    assert len(FP) == 16


# ---------------------------------------------------------------- corruption


def _flip(buf: bytes, offset: int) -> bytes:
    out = bytearray(buf)
    out[offset] ^= 0x01
    return bytes(out)


def test_codec_rejects_corruption() -> None:
    buf = encode_page(*random_kv(torch.float16), FP)
    header = parse_header(buf, FP)
    bad = {
        "payload byte": _flip(buf, len(buf) - 3),
        "first payload byte": _flip(buf, header.payload_offset),
        "checksum table": _flip(buf, HEADER_FIXED_SIZE + 5),
        "geometry field": _flip(buf, 12),
        "truncated by one": buf[:-1],
        "truncated header": buf[:40],
        "empty": b"",
        "trailing garbage": buf + b"\0",
        "bad magic": b"XXKVPAGE" + buf[8:],
        "version": _flip(buf, 8),
    }
    for what, data in bad.items():
        with pytest.raises(CorruptPageError):
            decode_page(data, FP)
            pytest.fail(f"{what} was not detected")
    with pytest.raises(ForeignPageError):
        decode_page(buf, OTHER_FP)
    # A damaged fingerprint is "corrupt", not "foreign" (the header crc covers it): a store
    # deletes corrupt pages but must leave other models' pages alone.
    for offset in (12, 33):  # page_size, a fingerprint byte
        for fp in (FP, OTHER_FP):
            with pytest.raises(CorruptPageError) as info:
                decode_page(_flip(buf, offset), fp)
            assert not isinstance(info.value, ForeignPageError)


def test_ranged_reader_verifies_exactly_what_it_reads() -> None:
    """Per-block checksums: damage outside a slice does not fail that slice's reader, damage
    inside it does, and a short range read is a truncation."""
    buf = encode_page(*random_kv(torch.float32), FP)
    header = parse_header(buf, FP)
    layers, heads = range(0, 2), range(2, 4)
    outside = header.block_offset(3, 1, 0) + 5  # layer 3, V, head 0
    inside = header.block_offset(1, 1, 3) + 5  # layer 1, V, head 3
    k, v = decode_page(_flip(buf, outside), FP, layers=layers, heads=heads)
    assert torch.equal(v, decode_page(buf, FP, layers=layers, heads=heads)[1])
    with pytest.raises(CorruptPageError):
        decode_page(_flip(buf, inside), FP, layers=layers, heads=heads)
    with pytest.raises(CorruptPageError):
        decode_page(_flip(buf, outside), FP)
    ranges = slice_offsets(header, layers, heads)
    chunks = [buf[o : o + n] for o, n in ranges]
    chunks[-1] = chunks[-1][:-1]
    with pytest.raises(CorruptPageError):
        decode_slice(header, chunks, layers=layers, heads=heads)
