"""The device KV pool and the request→token table.

Slot space: slot `s` is row `s` of every layer's K and V buffer. The driver's allocator owns the
slot space (which slots are free, which belong to the prefix tree, which to a request); this
module only stores rows. Slot 0 is the reserved padding slot (page 0 is never allocated), so a
padded token can write there harmlessly.

FP8 KV (`--kv-cache-dtype fp8_e4m3`): rows are stored as `float8_e4m3fn`, value / scale, with
one float32 scale per (layer, KV head) for K and one for V (`k_scale`, `v_scale`, [layers,
kv_heads]). Readers multiply back: the reference attention after its gather, the Triton
kernels by folding the K scale into the softmax scale and the V scale into the output (a
program owns one KV head, so both are scalars there). The scales are fixed for the pool's
life (1.0 unless set before the first store), so a row never changes meaning once written.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for `--kv-cache-dtype` (auto: the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected auto or fp8_e4m3")
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


class KVArena:
    """The device memory a rank's KV pools live in, layout after layout (resident, host-image
    and reload flips; not peer, whose build holds the old and the new shard at once).

    The launch layout's build reserves it: this rank's whole KV budget (what it could hold
    alone, before the ranks agree on the smallest slot count) less `headroom`, the bytes a
    later layout's shard on this rank needs beyond the launch layout's (weights that move at
    a seam are loaded with the arena still held; 0 for resident weights, all parked before
    the budget is read); every later pool of any
    layout views its first bytes, so a seam neither frees nor allocates the cache (on the
    H200 the 19 GiB pool's allocation was 0.09 s of a 0.25 s seam, and the free memory a
    rebuilt pool was sized from drifted) and every layout gets the budget a fresh launch
    would. A pool capped by --max-total-tokens that needs more bytes in another layout (more
    layers or KV heads on this rank) grows it: then, and only then, the address moves. Rows
    left by an earlier layout are never read: the scheduler's slot space starts empty at
    every seam. `free` returns it (the rank's end)."""

    def __init__(self, headroom: int = 0) -> None:
        self.buffer: torch.Tensor | None = None
        self.headroom = headroom  # bytes the launch budget leaves free (set by the rank)

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def reserve(self, nbytes: int, device: torch.device | str) -> None:
        """At least `nbytes`: allocated on first use, grown (freed and made again: no pool
        may be viewing it) when a capped pool needs more."""
        if self.buffer is not None and self.buffer.numel() >= nbytes:
            return
        self.free()
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def take(self, nbytes: int, device: torch.device | str) -> torch.Tensor:
        """The arena's first `nbytes` (uint8), reserved first if it has fewer."""
        self.reserve(nbytes, device)
        return self.buffer[:nbytes]

    def free(self) -> None:
        if self.buffer is not None:
            self.buffer.untyped_storage().resize_(0)
            self.buffer = None


class KVPool:
    """K and V buffers for the layers this process holds: `[num_slots, kv_heads, head_dim]` each."""

    def __init__(
        self,
        num_slots: int,
        layer_range: tuple[int, int],
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        arena: KVArena | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.arena = arena
        self.start_layer, self.end_layer = layer_range
        self.dtype = dtype
        shape = (num_slots, num_kv_heads, head_dim)
        n = self.end_layer - self.start_layer
        # One buffer `[layers, k|v, slots, heads, dim]`; k[i], v[i] are contiguous views of it,
        # exactly the per-layer tensors every reader uses. Read-only for others: it lets the
        # HiCache gather or scatter a page of every layer with one indexed copy.
        full = (n, 2, *shape)
        if arena is None:
            self.kv = torch.zeros(full, dtype=dtype, device=device)
        else:  # a view of the rank's arena (`KVArena`)
            nbytes = n * 2 * num_slots * num_kv_heads * head_dim * dtype.itemsize
            self.kv = arena.take(nbytes, device).view(dtype).view(full)
        self.k = [self.kv[i, 0] for i in range(n)]
        self.v = [self.kv[i, 1] for i in range(n)]
        # FP8 only: dequantization scales [layers, kv_heads] (None for a float pool)
        self.k_scale = self.v_scale = None
        if is_fp8(dtype):
            self.k_scale = torch.ones((n, num_kv_heads), dtype=torch.float32, device=device)
            self.v_scale = torch.ones((n, num_kv_heads), dtype=torch.float32, device=device)
        self.fp8_max = float(torch.finfo(dtype).max) if is_fp8(dtype) else None

    @staticmethod
    def bytes_per_slot(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one token slot takes (FP8: half of bf16; its scales are per layer, not per
        slot, so the same memory holds twice the tokens)."""
        return 2 * layers * kv_heads * head_dim * dtype.itemsize

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        i = layer_id - self.start_layer
        if self.k_scale is not None:  # written as bytes: index_put has no FP8 kernel on CPU
            self.k[i].view(torch.uint8)[slots] = self._quantize(k, self.k_scale[i]).view(
                torch.uint8)
            self.v[i].view(torch.uint8)[slots] = self._quantize(v, self.v_scale[i]).view(
                torch.uint8)
            return
        self.k[i][slots] = k.to(self.dtype)
        self.v[i][slots] = v.to(self.dtype)

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """[T, kv_heads, D] -> FP8 values x / scale (per head), saturated at the FP8 range."""
        return (x.float() / scale[:, None]).clamp_(-self.fp8_max, self.fp8_max).to(self.dtype)

    def scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) [kv_heads] float32 of an FP8 layer; None for a float pool."""
        if self.k_scale is None:
            return None
        i = layer_id - self.start_layer
        return self.k_scale[i], self.v_scale[i]

    def dequantized(self, layer_id: int, slots: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 K and V rows of `slots` ([S, kv_heads, D]): what a reader attends over."""
        k, v = self.layer(layer_id)
        kk, vv = k[slots].float(), v[slots].float()
        scales = self.scales(layer_id)
        if scales is not None:
            kk, vv = kk * scales[0][:, None], vv * scales[1][:, None]
        return kk, vv

    def release(self) -> None:
        """Frees the pool's memory in place (a flip's teardown): the storage itself shrinks to
        nothing, so views of it held anywhere (per-layer views, HiCache's page view) hold
        nothing big either. The device must be idle; the pool cannot be used afterwards. A
        pool in an arena lets go of its views only: the arena's memory is the next pool's."""
        if self.arena is None:
            self.kv.untyped_storage().resize_(0)
        else:  # no layer left to write into the next layout's rows through
            self.kv = self.kv[:0]
        self.k, self.v = [], []

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = layer_id - self.start_layer
        return self.k[i], self.v[i]


class ReqToTokenTable:
    """`table[row, pos]` is the slot of token `pos` of the request occupying `row`.

    Owned by the scheduler (host memory): forward plans carry the slots they need explicitly,
    so no rank ever reads this table. Entries beyond a request's KV length are stale.

    `epochs[row]` changes whenever entries a plan may already have carried can change: a new
    occupant (`alloc`) or a write from position 0 (admission's prefix match, a prefix rewritten
    to the tree's slots). Every other write appends at the request's allocation end, past any
    slot a plan has carried. So within one epoch a row only grows, which lets the plan sent to
    other ranks carry only each row's new slots (`distributed.plan_codec`).
    """

    def __init__(self, max_requests: int, max_context: int) -> None:
        self.table = torch.zeros((max_requests, max_context), dtype=torch.int64)
        self.epochs = np.zeros(max_requests, dtype=np.int64)
        self.max_context = max_context
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        if not self._free_rows:
            return None
        row = self._free_rows.pop()
        self.epochs[row] += 1
        return row

    def free(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"request table row {row} freed twice")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        if start == 0:
            self.epochs[row] += 1
        self.table[row, start : start + slots.numel()] = slots
