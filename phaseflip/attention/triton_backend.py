"""Triton attention backend: same contract as `TorchRefAttention`, fused GPU kernels.

`forward` stores the new tokens' K/V at `batch.out_cache_loc` (a torch index_put; the model
skips it with `kv_stored=True`, its rotary kernel having written the rows), then runs the
split-K decode kernel when every sequence has one new token, else the tiled extend kernel
(prefill, chunked prefill) — in a mixed batch the extend kernel for the longer sequences and
the decode kernel for the one-token ones. See `phaseflip.kernels.attention` for the kernels.

Per-batch metadata. A model forward calls `forward` once per layer with the same
`ForwardBatch`, and the metadata (query offsets, the extend tile list, the decode split plan and
its float32 workspace) depends only on the batch, the head layout and the sliding window. It is
built on the first layer from the batch's *host* lists (`extend_lens`, `prefix_lens`), copied to
the device once (pinned, non-blocking), and reused by the remaining layers: no host<->device sync
on the per-layer path. The cache holds one batch, matched by identity (`cached is batch`); it
keeps a reference to that batch so that its `id` cannot be recycled by a new batch while cached.
Inside it, a small dict keys the layout-dependent parts on (num_kv_heads, group, head_dim,
dtype, sliding_window), so models whose layers differ in window (Qwen2) get one entry per kind.
A `ForwardBatch` is treated as immutable once it reaches the backend.

The workspace is shared by all layers of one batch: layers run in order on one stream, so a
layer's reduce has consumed the partials before the next layer overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from phaseflip.cache.kv_pool import KVPool
from phaseflip.forward_batch import ForwardBatch
from phaseflip.kernels import attention as kernels
from phaseflip.kernels.attention_cuda import SPLIT_PLANS, CudaFp8Decode
from phaseflip.kernels.gemm_rows import empty_rows


def _to_device(data: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """int32 host list -> device tensor, through pinned memory so the copy does not block."""
    t = torch.tensor(data, dtype=torch.int32)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _Cache(NamedTuple):
    """One layer's paged K/V and, for an FP8 pool, its per-KV-head scales."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


@dataclass
class _BatchMeta:
    batch: ForwardBatch  # held so that the identity match cannot alias a recycled id
    is_decode: bool
    max_kv_len: int
    qo_indptr: torch.Tensor | None = None
    by_layout: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    # decode: the launch order (longest first) and the layer that sorts it, the first one a
    # forward reaches: every forward re-sorts there, so a graph's capture records the sort
    order: torch.Tensor | None = None
    order_layer: int | None = None


class TritonAttention:
    """Paged attention with Triton kernels (CUDA; CPU only under `TRITON_INTERPRET=1`).

    `decode_splits` forces the split-K count and `decode_min_chunk` the smallest split;
    `decode_config` / `extend_config` replace the per-dtype launch shapes (all for tests and
    tuning). By default the split count is planned per batch from the GPU's SM count.
    `mixed_decode=False` sends a mixed batch's one-token sequences through the extend kernel
    with the others (as before the decode kernel took them; for A/B runs and tests).
    `cuda_decode=False` keeps the unsplit FP8 decode launches on Triton rather than the CUDA
    kernel (`kernels.attention_cuda`, used where it loads: an sm_90 GPU with NVRTC);
    `cuda_splits` gives it the split plans too (default `attention_cuda.SPLIT_PLANS`).
    """

    name = "triton"
    graph_capturable = True

    def __init__(
        self,
        *,
        decode_splits: int | None = None,
        decode_min_chunk: int = kernels.MIN_CHUNK,
        decode_config: kernels.KernelConfig | None = None,
        extend_config: kernels.KernelConfig | None = None,
        mixed_decode: bool = True,
        cuda_decode: bool = True,
        cuda_splits: bool = SPLIT_PLANS,
    ) -> None:
        self.mixed_decode = mixed_decode
        self.cuda_decode = cuda_decode
        self.cuda_splits = cuda_splits
        self._cuda: CudaFp8Decode | None = None
        self._cuda_tried = False
        self.decode_splits = decode_splits
        self.decode_min_chunk = decode_min_chunk
        self.decode_config = decode_config
        self.extend_config = extend_config
        self._meta: _BatchMeta | None = None

    def _cuda_kernel(self, device: torch.device) -> CudaFp8Decode | None:
        """The CUDA decode kernel, compiled and loaded at the first decode outside a graph
        capture (a capture's warm-up runs come first); None where it cannot run."""
        if not self._cuda_tried and self.cuda_decode and device.type == "cuda" \
                and not torch.cuda.is_current_stream_capturing():
            self._cuda_tried = True
            self._cuda = CudaFp8Decode.create(device)
        return self._cuda

    def _batch_meta(self, batch: ForwardBatch, device: torch.device) -> _BatchMeta:
        meta = self._meta
        if meta is not None and meta.batch is batch:
            return meta
        seq_lens = [p + e for p, e in zip(batch.prefix_lens, batch.extend_lens)]
        meta = _BatchMeta(batch=batch, is_decode=batch.is_decode,
                          max_kv_len=max(seq_lens, default=0))
        if not meta.is_decode:
            indptr = [0]
            for e in batch.extend_lens:
                indptr.append(indptr[-1] + e)
            meta.qo_indptr = _to_device(indptr, device)
        self._meta = meta
        return meta

    def bind_graph_batch(self, batch: ForwardBatch, max_kv_len: int) -> object:
        """CUDA-graph capture hook: plans the decode `batch` (views of a graph's static input
        buffers) for every context up to `max_kv_len`, so the grid and workspace recorded by
        the capture hold for any replay. The kernels read lengths from the device
        `kv_indptr` and cut each sequence's split chunks themselves.

        Returns the batch state (split plans and workspaces, filled by the first forward);
        the caller keeps it alive as long as the graph, whose kernels address that memory.
        """
        if not batch.is_decode:
            raise ValueError("only decode batches are captured")
        self._meta = _BatchMeta(batch=batch, is_decode=True, max_kv_len=max_kv_len)
        return self._meta

    @staticmethod
    def _decode_order(meta: _BatchMeta, layer_id: int, batch: ForwardBatch) -> torch.Tensor:
        """The batch's sequences longest first, sorted once a forward: at the layer that
        sorted first (so the warm-up runs of a graph capture do not leave the capture a
        stale order), reused by the others."""
        if meta.order is None or layer_id == meta.order_layer:
            meta.order = kernels.decode_order(batch.kv_indptr)
            meta.order_layer = layer_id
        return meta.order

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
        out: torch.Tensor | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] for the new tokens. Returns [T, H*D] in q's dtype.

        `out` (optional, [T, H*D] in q's dtype) receives the result instead of a fresh tensor.
        `kv_stored`: the new K/V are already in the pool (the model's fused rotary + store).
        """
        if not kv_stored:
            pool.store(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = pool.layer(layer_id)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        scales = pool.scales(layer_id)  # FP8 pool: per-KV-head K and V scales
        k_scale, v_scale = scales if scales is not None else (None, None)
        dtype = kernels.compute_dtype(q.dtype, k_cache.dtype)
        if out is None:  # rows padded for the o projection's GEMM (`kernels.gemm_rows`)
            out = empty_rows(q.shape[0], num_heads * head_dim, q.dtype, q.device, fp8=False)
        if q.shape[0] == 0:
            return out
        meta = self._batch_meta(batch, q.device)
        key = (num_kv_heads, group, head_dim, dtype, sliding_window)
        cache = _Cache(k_cache, v_cache, k_scale, v_scale)
        if meta.is_decode:
            return self._decode(layer_id, q, cache, batch, meta, key, scale, sliding_window, out)
        return self._extend(q, cache, batch, meta, key, scale, sliding_window, out)

    def _decode(self, layer_id: int, q: torch.Tensor, cache: _Cache, batch: ForwardBatch,
                meta: _BatchMeta, key: tuple[Any, ...], scale: float,
                sliding_window: int | None, out: torch.Tensor) -> torch.Tensor:
        """Every sequence has one new token: the CUDA FP8 kernel where it takes the launch
        (unsplit plans; split ones too under `cuda_splits`), else the Triton split-K decode
        kernel."""
        num_kv_heads, group, head_dim, dtype = key[:4]
        cfg = self._decode_cfg(dtype, head_dim, group, q.device, cache.k.dtype)
        head_blocks = -(-group // cfg.block_m)
        cached = meta.by_layout.get(key)
        if cached is None:
            plan = self._plan(batch.batch_size, num_kv_heads, head_blocks, meta.max_kv_len,
                              sliding_window, q.device)
            ws = None
            if plan.num_splits > 1:
                ws = kernels.decode_workspace(batch.batch_size, q.shape[1], head_dim, plan,
                                              q.device)
            cached = meta.by_layout[key] = (plan, ws)
        plan, ws = cached
        order = None
        if kernels.orders_decode(batch.batch_size, num_kv_heads, head_blocks,
                                 kernels.num_sms(q.device)):
            order = self._decode_order(meta, layer_id, batch)
        cuda = self._cuda_kernel(q.device) if plan.num_splits == 1 or self.cuda_splits else None
        if cuda is not None and cuda.accepts(q, cache.k, cache.v, out, batch.kv_indptr,
                                             batch.kv_indices, cache.k_scale, cache.v_scale,
                                             order, sliding_window):
            return cuda(q, cache.k, cache.v, batch.kv_indptr, batch.kv_indices, cache.k_scale,
                        cache.v_scale, scale, out, order, plan, ws)
        return kernels.decode_attention(
            q, cache.k, cache.v, batch.kv_indptr, batch.kv_indices, scale, plan,
            sliding_window=sliding_window, out=out, workspace=ws, config=cfg,
            k_scale=cache.k_scale, v_scale=cache.v_scale, order=order,
        )

    def _extend(self, q: torch.Tensor, cache: _Cache, batch: ForwardBatch, meta: _BatchMeta,
                key: tuple[Any, ...], scale: float, sliding_window: int | None,
                out: torch.Tensor) -> torch.Tensor:
        """Prefill / mixed batches: a mixed batch's one-token sequences through the decode
        kernel, the rest through the tiled extend kernel."""
        assert meta.qo_indptr is not None
        num_heads, head_dim = q.shape[1], q.shape[2]
        group, dtype = key[1], key[3]
        one_token = self._mixed_decode(meta, batch, key, q.device, num_heads, head_dim,
                                       cache.k.dtype, sliding_window)
        if one_token is not None:  # a mixed batch's one-token sequences: the decode kernel
            seqs, plan, ws, dcfg = one_token
            kernels.mixed_decode_attention(
                q, cache.k, cache.v, meta.qo_indptr, batch.kv_indptr, batch.kv_indices, seqs,
                scale, plan, out, sliding_window=sliding_window, workspace=ws, config=dcfg,
                k_scale=cache.k_scale, v_scale=cache.v_scale,
            )
        cfg = self.extend_config or kernels.extend_config(dtype, head_dim, q.device,
                                                          cache.k.dtype)
        tkey = ("tiles", group, cfg.block_m)
        tiles = meta.by_layout.get(tkey)
        if tiles is None:
            ext = batch.extend_lens
            if one_token is not None:  # their rows are done: no tiles for them
                ext = [0 if e == 1 else e for e in ext]
            host = kernels.extend_tiles(ext, batch.prefix_lens, group, cfg.block_m)
            tiles = meta.by_layout[tkey] = _to_device(host, q.device)
        return kernels.extend_attention(
            q, cache.k, cache.v, meta.qo_indptr, batch.kv_indptr, batch.kv_indices, tiles,
            scale, sliding_window=sliding_window, out=out, config=cfg,
            k_scale=cache.k_scale, v_scale=cache.v_scale,
        )

    def _decode_cfg(self, dtype: torch.dtype, head_dim: int, group: int,
                    device: torch.device, kv_dtype: torch.dtype) -> kernels.KernelConfig:
        return self.decode_config or kernels.decode_config(dtype, head_dim, group, device,
                                                           kv_dtype)

    def _plan(self, sequences: int, num_kv_heads: int, head_blocks: int, max_len: int,
              window: int | None, device: torch.device) -> kernels.DecodePlan:
        """The split plan of a decode launch over `sequences` whose longest attended range
        is `max_len` keys (clipped to the window)."""
        if window is not None:
            max_len = min(max_len, window)
        return kernels.plan_decode(sequences, num_kv_heads, head_blocks, max_len,
                                   kernels.num_sms(device), num_splits=self.decode_splits,
                                   min_chunk=self.decode_min_chunk)

    def _mixed_decode(self, meta: _BatchMeta, batch: ForwardBatch, key: tuple[Any, ...],
                      device: torch.device, num_heads: int, head_dim: int,
                      kv_dtype: torch.dtype, window: int | None) -> tuple | None:
        """(sequences, plan, workspace, config) for the decode kernel over the one-token
        sequences of a batch that also extends longer ones, or None (no such sequence, or
        `mixed_decode` off). In the extend kernel each of them costs a BLOCK_M-row tile per
        KV head for `group` rows; the decode kernel reads its keys once for the group. They
        launch longest first (host lengths, no sort on the device)."""
        mkey = ("mixed", *key)
        if mkey in meta.by_layout:
            return meta.by_layout[mkey]
        ext, pre = batch.extend_lens, batch.prefix_lens
        one = [i for i, e in enumerate(ext) if e == 1]
        found = None
        if self.mixed_decode and one and len(one) < len(ext):
            one.sort(key=lambda i: -pre[i])
            num_kv_heads, group, _, dtype, _ = key
            cfg = self._decode_cfg(dtype, head_dim, group, device, kv_dtype)
            plan = self._plan(len(one), num_kv_heads, -(-group // cfg.block_m),
                              max(pre[i] for i in one) + 1, window, device)
            # (always through the partials: `mixed_decode_attention` never writes directly)
            ws = kernels.decode_workspace(len(ext), num_heads, head_dim, plan, device)
            found = (_to_device(one, device), plan, ws, cfg)
        meta.by_layout[mkey] = found
        return found
