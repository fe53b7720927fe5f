"""CUDA graphs for prefill and mixed steps, in pieces: everything but attention.

Why: a step that carries a new prompt (a prefill, or a prompt beside running decodes) cannot
replay a decode graph, and launched from Python its ~12 kernels a layer cost far more host time
than GPU time. On the H200 (8B, FP8, one 32-token prompt beside 6 decodes,
`benchmarks/profile_mixed_step.py`) such a step took 45 ms, 44 ms of it the forward's host
time, for 5.4 ms of kernels: every running stream stalled that long, and each new request
waited that long for its first token.

How: the attention kernels' grids and metadata depend on the batch (how many sequences, how
long each prompt), everything else only on the step's token count. So for a token bucket T the
stage's layers are captured as `layers + 1` graphs cut at each attention: graph i runs from
layer i-1's output projection (the embedding for i = 0) through layer i's qkv projection and
its rotary + KV store, and copies q into a static buffer; the last graph runs the last layer's
MLP. A step of t <= T tokens copies its ids, positions and slots into static buffers (rows
past t: token 0 at position 0, K/V to the pool's padding slot), then replays graph 0, runs
layer 0's attention eagerly over the real rows (the plan's own metadata, static q in, static
output rows out), replays graph 1, and so on. Rows never mix outside attention (norms,
projections and activations are row-wise), so padding rows cannot reach real ones.

The graphs of every bucket share one memory pool, one q buffer and one attention-output
buffer: buckets never run at once, and within a step the pieces run in order on one stream.
Tensors that cross a cut (the residual stream) stay referenced until their bucket's capture
ends, so no later piece of that bucket reuses them; another bucket's capture may, which is
safe because a bucket's pieces and the attention between them run back to back.

Layouts. Under TP the pieces hold the layers' all-reduces (every TP rank captures the same
buckets in the same order at build and runs the same plans, so the collectives pair up, as in
the decode graphs); attention between them is rank-local. A later pipeline stage's pieces read
static (hidden, residual) input buffers, filled from what the previous stage sent (padding rows
zeroed: the fused add-norm updates the residual in place); a stage other than the last
returns every row's (hidden, residual). Captured at build only, with recorded decode graphs
(so not for TP over gloo staging); a phase flip's new layout runs these steps eagerly.
`--piecewise-graph-max-tokens 0` turns them off.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from phaseflip.attention import AttentionBackend
from phaseflip.cache.kv_pool import KVPool
from phaseflip.forward_batch import ForwardBatch
from phaseflip.heap import collector_paused
from phaseflip.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

PAD_SLOT = 0  # the allocator never hands out page 0: padding rows write their K/V there


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: dense where steps are short (a prompt joining a few decodes),
    coarser above, so padding costs at most a third of a step's rows (up to 16 384 tokens)."""
    sizes = [16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
             8192, 12288, 16384]
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


@dataclass(frozen=True)
class _Cut:
    """One attention between two pieces: the layer's arguments to the backend."""

    layer_id: int
    scale: float
    sliding_window: int | None


@dataclass
class _Bucket:
    """A token bucket's pieces: `graphs[i]` runs before `cuts[i]`, the last after them."""

    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    hidden: torch.Tensor | None = None  # [T, hidden] outputs of the last piece
    residual: torch.Tensor | None = None


class _Cutter:
    """The attention backend a capture runs the model with: at each layer's attention it
    copies q into the static buffer, closes the piece being captured, opens the next, and
    hands back the static output rows the next piece's projection reads. Outside a capture
    (the warm-up run that compiles kernels and sizes workspaces) it only copies."""

    name = "piecewise-cutter"
    graph_capturable = True

    def __init__(self, owner: PiecewiseGraphs, bucket: _Bucket, capturing: bool) -> None:
        self.owner, self.bucket, self.capturing = owner, bucket, capturing

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, scale: float,
                sliding_window: int | None = None, *, out: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            raise RuntimeError("piecewise graphs need the model's fused rotary + KV store")
        t = q.shape[0]
        self.owner.q_buf[:t].copy_(q)
        if self.capturing:
            self.bucket.cuts.append(_Cut(layer_id, scale, sliding_window))
            self.owner.next_piece(self.bucket)
        return self.owner.o_buf[:t]


class _Splice:
    """The attention backend of an unrecorded run (`record=False`): the layers run eagerly
    over the padded static rows, and at each attention the real backend runs as a replay
    would, over the real rows through the static q and output buffers."""

    name = "piecewise-splice"
    graph_capturable = False

    def __init__(self, owner: PiecewiseGraphs, plan: ForwardBatch) -> None:
        self.owner, self.plan = owner, plan

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, pool: KVPool, scale: float,
                sliding_window: int | None = None, *, out: torch.Tensor | None = None,
                kv_stored: bool = False) -> torch.Tensor:
        rows = q.shape[0]
        self.owner.q_buf[:rows].copy_(q)
        self.owner.attend(_Cut(layer_id, scale, sliding_window), self.plan)
        return self.owner.o_buf[:rows]


class PiecewiseGraphs:
    """Piecewise CUDA graphs of one whole-model process for steps of up to `max_tokens`
    tokens (see the module docstring). `run` replays a bucket around eager attention.

    With `record=False` nothing is captured and `run` executes the same pieces eagerly over
    the same static buffers and padding (`_Splice`): the CPU tests check the buffer filling,
    the padding and the real-rows-only attention without a GPU."""

    def __init__(self, model: LlamaForCausalLM, pool: KVPool, backend: AttentionBackend, *,
                 max_tokens: int, max_context: int, record: bool = True) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self.max_context, self.record = max_context, record
        self.buckets = token_buckets(max_tokens)
        self.max_tokens = self.buckets[-1]
        device = pool.k[0].device
        self.device = device
        n = self.max_tokens
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.full((n,), PAD_SLOT, dtype=torch.int64, device=device)
        attn = model.layers[0].self_attn
        width, dtype = attn.num_heads * attn.head_dim, model.dtype
        self.q_buf = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)
        self.o_buf = torch.zeros(n, width, dtype=dtype, device=device)
        self.in_hidden = self.in_residual = None
        if not model.layout.is_first_stage:  # its input arrives from the previous stage
            size = model.cfg.hidden_size
            self.in_hidden = torch.zeros(n, size, dtype=dtype, device=device)
            self.in_residual = torch.zeros(n, size, dtype=dtype, device=device)
        self.captured: dict[int, _Bucket] = {}
        self._mempool = None
        self._side: torch.cuda.Stream | None = None
        self._rope_table: torch.Tensor | None = None

    # ------------------------------------------------------------------ capture
    def _static_batch(self, t: int) -> ForwardBatch:
        """What the captured layers read of a batch: ids, positions, slots (the cutter
        stands in for attention, which reads the rest)."""
        return ForwardBatch(
            input_ids=self.input_ids[:t], positions=self.positions[:t],
            out_cache_loc=self.out_cache_loc[:t], extend_lens=[t], prefix_lens=[0],
            kv_indptr=self.positions[:2], kv_indices=self.out_cache_loc[:t],
            logits_indices=self.positions[:1], max_position=0,
        )

    def _inputs(self, t: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """A later stage's static (hidden, residual) input rows; (None, None) on stage 0."""
        if self.in_hidden is None:
            return None, None
        return self.in_hidden[:t], self.in_residual[:t]

    def capture(self, capture_stream: torch.cuda.Stream | None) -> None:
        """Captures every bucket on `capture_stream` (the decode graphs' side stream),
        largest first (smaller ones reuse its pool memory); only marks them captured when not
        recording."""
        self.model.rope.ensure_capacity(self.max_context)
        self._rope_table = self.model.rope.cos_cache
        if not self.record:
            self.captured = {t: _Bucket() for t in self.buckets}
            return
        self._mempool = torch.cuda.graph_pool_handle()
        self._side = capture_stream
        for t in tqdm(sorted(self.buckets, reverse=True), desc="capturing prefill graphs",
                      unit="graph", leave=False):
            self._capture_bucket(t)
        log.info("captured piecewise CUDA graphs for prefill/mixed steps of %s tokens",
                 self.buckets)

    @torch.inference_mode()
    def _capture_bucket(self, t: int) -> None:
        batch = self._static_batch(t)
        side = self._side
        torch.cuda.synchronize(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            # compiles kernels and sizes the GEMM workspace outside the capture
            self.model.forward_layers(batch, self.pool, _Cutter(self, _Bucket(), False),
                                      *self._inputs(t))
            bucket = _Bucket()
            with collector_paused():  # no older graph freed mid-capture (`heap.py`)
                self.next_piece(bucket)
                hidden, residual = self.model.forward_layers(
                    batch, self.pool, _Cutter(self, bucket, True), *self._inputs(t))
                bucket.graphs[-1].capture_end()
        torch.cuda.current_stream(self.device).wait_stream(side)
        bucket.hidden, bucket.residual = hidden, residual
        self.captured[t] = bucket
        torch.cuda.synchronize(self.device)

    def next_piece(self, bucket: _Bucket) -> None:
        """Ends the piece being captured (if any) and begins the next one."""
        if bucket.graphs:
            bucket.graphs[-1].capture_end()
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (HiCache copies) may not invalidate it
        graph.capture_begin(pool=self._mempool, capture_error_mode="thread_local")
        bucket.graphs.append(graph)

    def release(self) -> None:
        for bucket in self.captured.values():
            for graph in bucket.graphs:
                graph.reset()
        self.captured.clear()

    # ------------------------------------------------------------------ replay
    def can_run(self, plan: ForwardBatch) -> bool:
        """A plan of 1..max_tokens tokens whose bucket is captured, within the rope table the
        pieces read (regrown since: a stale address)."""
        t = plan.input_ids.numel()
        return (0 < t <= self.max_tokens
                and self.buckets[bisect.bisect_left(self.buckets, t)] in self.captured
                and plan.max_position < self.max_context
                and self.model.rope.cos_cache is self._rope_table)

    def run(self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
            residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of the plan's rows after this stage's layers, as
        `LlamaForCausalLM.forward_layers` returns them: views of the bucket's outputs, valid
        until the next run. `plan` must be on the device (the attention reads it); a later
        stage passes the previous stage's (hidden, residual) rows."""
        t = plan.input_ids.numel()
        b = self.buckets[bisect.bisect_left(self.buckets, t)]
        bucket = self.captured[b]
        if self.in_hidden is not None:
            self.in_hidden[:t].copy_(hidden)
            self.in_residual[:t].copy_(residual)
            self.in_hidden[t:b].zero_()
            self.in_residual[t:b].zero_()
        self.input_ids[:t].copy_(plan.input_ids, non_blocking=True)
        self.positions[:t].copy_(plan.positions, non_blocking=True)
        self.out_cache_loc[:t].copy_(plan.out_cache_loc, non_blocking=True)
        if b > t:
            self.input_ids[t:b].zero_()
            self.positions[t:b].zero_()
            self.out_cache_loc[t:b].fill_(PAD_SLOT)
        if not self.record:
            out, res = self.model.forward_layers(self._static_batch(b), self.pool,
                                                 _Splice(self, plan), *self._inputs(b))
            return out[:t], res[:t]
        for graph, cut in zip(bucket.graphs, bucket.cuts):
            graph.replay()
            self.attend(cut, plan)
        bucket.graphs[-1].replay()
        return bucket.hidden[:t], bucket.residual[:t]

    def attend(self, cut: _Cut, plan: ForwardBatch) -> None:
        """One layer's attention over the plan's rows: static q in, static output rows out
        (the K/V are in the pool already: the piece stored them)."""
        t = plan.input_ids.numel()
        q, out = self.q_buf[:t], self.o_buf[:t]
        k, v = (c[:t] for c in self.pool.layer(cut.layer_id))  # shapes only: K/V are stored
        if self.backend.graph_capturable:
            self.backend.forward(cut.layer_id, q, k, v, plan, self.pool, cut.scale,
                                 cut.sliding_window, out=out, kv_stored=True)
        else:  # the reference attention (CPU tests) returns a new tensor
            out.copy_(self.backend.forward(cut.layer_id, q, k, v, plan, self.pool, cut.scale,
                                           cut.sliding_window, kv_stored=True))
