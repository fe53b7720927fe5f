"""A large decode batch as two halves in flight: one half's attention under the other's GEMMs.

Why: a decode step of hundreds of sequences spends about as long in attention (memory-bound:
each sequence's K/V read once) as in the projections (compute-bound), and run one after the
other each leaves the other's resource idle. Cut in two halves A and B, the layers run as

    main stream:  qkv(A,l)  o+mlp(B,l-1)  qkv(B,l)  o+mlp(A,l)  qkv(A,l+1)  o+mlp(B,l) ...
    attn stream:     attn(A,l) ---------->  attn(B,l) ----------->  attn(A,l+1) ...

so each half's rotary, KV store and attention run beside the other half's projections
(docs/benchmarks.md has what it buys, `benchmarks/nano_overlap_probe.py` the layer-level
probe). The price: every weight is read twice a step (each half's GEMMs), which is why small
batches, whose GEMMs are bound by those reads, run whole.

Safety across the two streams, in launch order: the attention stream waits for everything the
main stream launched before it (so a half's qkv is done, and the memory the other half freed
is no longer read); the main stream waits for a half's attention before its o projection.
A half's projected q/k/v stay referenced until that wait, so the main stream cannot reuse
their memory while the attention stream still reads it.

One rank only (tp 1, pp 1): a TP rank's all-reduces would sit between the halves' GEMMs on
the main stream, and a pipeline stage's halves would need their own hand-offs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from phaseflip.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from phaseflip.attention import AttentionBackend
    from phaseflip.cache.kv_pool import KVPool
    from phaseflip.model.llama import LlamaForCausalLM


@dataclass
class DecodeHalves:
    """The two halves of one decode batch and the stream their attention runs on (None: one
    stream, the same work in the same order: CPU runs and tests)."""

    halves: tuple[ForwardBatch, ForwardBatch]
    stream: torch.cuda.Stream | None


def split_decode(batch: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """Rows [0, h) and [h, B) of a decode batch, h = B // 2, as views: each half keeps the
    whole `kv_indices` and its own rows of `kv_indptr` (offsets into the whole list, which
    the decode kernels read per sequence), so no offset needs the device's values and the
    halves of a CUDA graph's static batch stay views of its buffers."""
    if not batch.is_decode or batch.batch_size < 2:
        raise ValueError("only a decode batch of two or more sequences is halved")
    b = batch.batch_size
    h = b // 2

    def rows(a: int, z: int) -> ForwardBatch:
        return dataclasses.replace(
            batch, input_ids=batch.input_ids[a:z], positions=batch.positions[a:z],
            out_cache_loc=batch.out_cache_loc[a:z], extend_lens=batch.extend_lens[a:z],
            prefix_lens=batch.prefix_lens[a:z], kv_indptr=batch.kv_indptr[a : z + 1],
            logits_indices=batch.logits_indices[: z - a], rows=None, row_epochs=None,
            delta=None, future_pos=None, future_rows=None)

    return rows(0, h), rows(h, b)


def forward_halves(model: LlamaForCausalLM, halves: DecodeHalves, pool: KVPool,
                   backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, residual) of every row of the whole batch after the model's layers (one rank:
    the embedding through the last layer), the halves pipelined as the module says."""
    layout = model.layout
    if layout.tp_size != 1 or not (layout.is_first_stage and layout.is_last_stage):
        raise ValueError("two decode halves in flight need one rank (tp 1, pp 1)")
    a, b = halves.halves
    side = halves.stream
    main = torch.cuda.current_stream() if side is not None else None
    layers = model.layers
    n = len(layers)
    xs = [model.embed_tokens(h.input_ids) for h in (a, b)]
    res: list[torch.Tensor | None] = [None, None]
    rotary = [model.rope.for_batch(h.positions, xs[0].dtype, max_position=h.max_position)
              for h in (a, b)]
    # per half: (its q/k/v, held until its o projection; the attention output; its event)
    pending: list[tuple | None] = [None, None]

    def attend(k: int, i: int) -> None:
        qkv, res[k] = layers[i].project_qkv(xs[k], res[k])
        half = halves.halves[k]
        if side is None:
            pending[k] = (qkv, layers[i].self_attn.attend(*qkv, half, rotary[k], pool,
                                                          backend), None)
            return
        side.wait_stream(main)
        with torch.cuda.stream(side):
            o = layers[i].self_attn.attend(*qkv, half, rotary[k], pool, backend)
            done = torch.cuda.Event()
            done.record(side)
        pending[k] = (qkv, o, done)

    def finish(k: int, i: int) -> None:
        _, o, done = pending[k]
        if done is not None:
            main.wait_event(done)
        xs[k], res[k] = layers[i].finish(o, res[k], fold_out=i < n - 1)
        pending[k] = None

    attend(0, 0)
    attend(1, 0)
    for i in range(n):
        finish(0, i)
        if i + 1 < n:
            attend(0, i + 1)
        finish(1, i)
        if i + 1 < n:
            attend(1, i + 1)
    return torch.cat(xs), torch.cat(res)
