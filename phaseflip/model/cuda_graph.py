"""CUDA graphs for decode steps.

Why: one decode step of an 8B Llama is ~400 kernel launches. Launched from Python each costs
several microseconds of host time, more than the GPU needs for most of them at small batch, so
the GPU idles between kernels and batch-1 decode is bound by the host. A graph replays the whole
step's launches with one call.

How: for every captured batch size `bs`, the graph records the model's forward (embedding, all
layers, final norm) over views of static device buffers: token ids, positions, output slots,
`kv_indptr` and `kv_indices`. A decode plan of `B <= bs` sequences is copied into those buffers
and padded to `bs` with dummy sequences of length one that read and write slot 0 (the pool's
reserved padding page), then the graph is replayed. On the last stage the graph goes on
through the LM head: under TP each rank's vocabulary shard is gathered to TP rank 0, the rank
that samples (the others send and receive nothing), so a TP decode step replays one graph up to
the logits. Every size writes its logits into ONE static float32 `[max_bs, vocab]` buffer (a
buffer per size would cost gigabytes at a 128k vocabulary): logits a replay hands back are
valid until the next replay. Sampling runs eagerly after it.

The attention backend's capture hook plans the decode kernels once for the longest context the
engine admits (the kernels cut each sequence's split-K chunks from its own device-side length),
so one graph serves every mix of context lengths. A plan the buffers cannot hold (more context
slots than the static `kv_indices`, a batch above the largest size) runs eagerly instead.

Sizes are captured into one shared memory pool: graphs never run concurrently, so each graph
reuses the others' intermediate memory. At launch every size is captured, largest first
(`capture`); a phase flip's new layout only prepares (`prepare`) and captures each size on its
first replay, so the seam does not wait for sizes the next steps may never use (an 8B pp2
stage took 0.38-0.57 s to capture all of them on the H200). A first-use capture runs over the
padding batch, before the plan is copied in, and every TP rank reaches it at the same step.

With resident weights (`--flip-weights resident`) a layout's graphs outlive its seam: they are
parked with the layout's model (`park`) and adopted by its next build (`adopt`), which then
replays them as they were instead of capturing again (the census says `parked`). A graph is
only valid while every address it captured outside itself is unchanged: the weights and rope
tables (the parked model's), the KV pool (a view of the rank's `KVArena` at the same offsets),
the communicator's process group and any device buffers it exposes (`graph_addresses()`), and
the static buffers. `addresses` fingerprints them when the sizes may first be captured
(`prepare`); `adopt` compares, and the caller falls back to first-use capture if anything moved.
What the graphs own (static buffers, logits buffer, attention workspaces, their private memory
pool, the GEMM workspaces they captured) stays allocated while they are parked
(`device_bytes`).

With `record=False` nothing is captured and a replay runs the same forward eagerly over the
same static buffers: the CPU tests use it to check the buffer filling, the padding and the
longest-context attention plan without a GPU. `PHASEFLIP_UNRECORDED_GRAPHS=1` gives a CPU
engine's ranks such graphs (tests: parking and adoption through real flips); with the reference
attention, which reads each sequence's prefix length on the host, a replay hands it the static
batch's lengths.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from phaseflip.attention import AttentionBackend
from phaseflip.cache.kv_pool import KVPool
from phaseflip.forward_batch import ForwardBatch
from phaseflip.heap import collector_paused
from phaseflip.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

PAD_SLOT = 0  # the allocator never hands out page 0: padding rows write their K/V here
# tests: "1" gives CPU runners unrecorded graphs (`record=False`), to park and adopt on flips
UNRECORDED_ENV = "PHASEFLIP_UNRECORDED_GRAPHS"


def _address(t: torch.Tensor | None) -> tuple | None:
    """Where a captured kernel reads or writes `t`: its base pointer and geometry."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _comm_address(comm: object) -> tuple:
    """The communicator a graph's collectives run on: its process group and any device
    buffers it exposes (`graph_addresses()`, e.g. symmetric-memory all-reduce buffers)."""
    buffers = getattr(comm, "graph_addresses", None)
    return (type(comm).__name__, id(getattr(comm, "group", None)),
            tuple(buffers()) if buffers is not None else ())


def capture_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture: dense at the small end (batch 1-8 is latency-critical), every
    16 above 32 and every 32 above 256, so padding wastes at most 15 (31) rows where rows are
    cheap."""
    sizes = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, 257, 16)) + list(range(288, 1025, 32))
    sizes = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(sizes))


@dataclass
class _Captured:
    batch: ForwardBatch  # views of the static buffers, `bs` rows
    graph: torch.cuda.CUDAGraph | None  # None: replays run eagerly (record=False)
    # [bs, hidden] outputs written by every replay: the final-normed states on the last stage
    # (residual None), the (hidden, residual) pair another stage receives elsewhere
    hidden: torch.Tensor | None
    residual: torch.Tensor | None
    # [bs, vocab] float32 rows of the shared logits buffer: the last stage's sampling rank only
    logits: torch.Tensor | None
    backend_state: object  # the attention backend's plans/workspaces the graph addresses


@dataclass
class GraphReuse:
    """A layout's decode graphs parked at its last seam, offered to its next build, and the
    group's vote on them: every rank adopts its parked graphs or none does (a TP rank
    capturing a size on first use while its peers replay theirs would pair the collectives
    of the capture's warm-up runs with nothing: law 4)."""

    parked: DecodeGraphs | None  # None: none parked on this rank (it still votes)
    agree: Callable[[bool], bool]  # this rank's verdict -> whether every rank's was yes



@functools.cache
def capture_stream(device_index: int) -> torch.cuda.Stream:
    """The one stream a process captures its decode graphs on, per device. cuBLAS keeps a
    workspace per (handle, stream) and a captured graph holds on to it, so a new stream per
    capture (every non-parked layout build of a flip) would add a workspace per build, kept
    for the process's life once graphs are parked. Graphs on one rank never replay at once,
    so sharing the capture stream (and its workspace) is safe."""
    return torch.cuda.Stream(torch.device("cuda", device_index))

class DecodeGraphs:
    """Captured decode graphs of one model stage and their static input buffers.

    Under tensor parallelism the graphs contain the layers' NCCL all-reduces and, on the last
    stage, the LM head's gather (every TP rank captures the same sizes in the same order, so
    the collectives pair up). A pipeline stage
    after the first also gets static (hidden, residual) input buffers, filled from what the
    previous stage sent; the hand-off between stages stays outside the graphs.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        backend: AttentionBackend,
        *,
        max_bs: int,
        max_context: int,
        max_kv_tokens: int,
        record: bool = True,
    ) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        self.record = record
        self.max_context = max_context
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        device = pool.k[0].device
        self.device = device
        n = self.max_bs
        def ints(size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = ints(n), ints(n), ints(n)
        self.kv_indptr, self.kv_indices = ints(n + 1), ints(max_kv_tokens + n)
        self._reset_buffers()  # the padding batch the warm-up runs of a capture execute
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.in_hidden = self.in_residual = None
        if model.start_layer > 0:  # a later pipeline stage: its input arrives from the previous
            width, dtype = model.cfg.hidden_size, model.dtype  # not the pool's (FP8 KV)
            self.in_hidden = torch.zeros(n, width, dtype=dtype, device=device)
            self.in_residual = torch.zeros(n, width, dtype=dtype, device=device)
        self.logits_out = None  # the sampling rank's logits, shared by every size
        last = model.layout.is_last_stage
        if last and model.layout.tp_rank == 0:
            self.logits_out = torch.empty(n, model.lm_head.padded_vocab, dtype=torch.float32,
                                          device=device)
        self.with_logits = last
        self.graphs: dict[int, _Captured] = {}
        self._rope_table: torch.Tensor | None = None
        self._mempool = self._side = None  # set by `prepare`
        # what the captures address outside these graphs, read by `prepare` (see `adopt`)
        self.addresses: dict[str, object] | None = None
        self._gemm_workspaces: list[object] = []  # the split-K workspaces captures used

    def _reset_buffers(self) -> None:
        """The static buffers as a valid padding batch (every sequence one token over slot
        0), what the warm-up runs of a capture execute."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.fill_(PAD_SLOT)
        torch.arange(self.max_bs + 1, out=self.kv_indptr)
        self.kv_indices.fill_(PAD_SLOT)

    # ------------------------------------------------------------------ capture
    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], extend_lens=[1] * bs, prefix_lens=[0] * bs,
            kv_indptr=self.kv_indptr[: bs + 1], kv_indices=self.kv_indices,
            logits_indices=self.rows[:bs], max_position=0,
        )

    def _run(self, batch: ForwardBatch
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(hidden, residual, logits): the stage's forward, on the last stage through the LM
        head into the shared logits buffer (logits None on the other TP ranks)."""
        bs = batch.batch_size
        if self.in_hidden is None:
            hidden, residual = self.model(batch, self.pool, self.backend)
        else:
            hidden, residual = self.model(batch, self.pool, self.backend, self.in_hidden[:bs],
                                          self.in_residual[:bs])
        if not self.with_logits:
            return hidden, residual, None
        out = None if self.logits_out is None else self.logits_out[:bs]
        return hidden, residual, self.model.lm_head.logits(hidden, out)

    def _warm_linears(self) -> None:
        """Compiles the skinny-GEMM variants the captured sizes use and sizes its split-K
        workspace, which must not grow during a capture; and the tile GEMM's tabled shapes
        (mixed steps of those row counts run it eagerly too)."""
        if self.device.type != "cuda":
            return
        from phaseflip.kernels import linear as skinny
        from phaseflip.kernels import linear_configs as cfgs
        from phaseflip.kernels import tile_gemm

        cfgs.load_bundled_configs(self.device)
        weights = [p for n, p in self.model.named_parameters()
                   if p.dim() == 2 and "embed_tokens" not in n]
        if self.with_logits and all(w is not self.model.lm_head.weight for w in weights):
            weights.append(self.model.lm_head.weight)  # tied: named after the embedding
        if self.with_logits and self.model.lm_head.fp8:  # what its logits GEMM reads
            weights.append(self.model.lm_head.fp8_weight)
        shapes = {(w.shape[0], w.shape[1]) for w in weights}
        m_values = [b for b in self.sizes if b <= cfgs.KERNEL_MAX_M
                    and any(cfgs.should_use_skinny(b, n, k) for n, k in shapes)]
        for wdtype in {w.dtype for w in weights}:
            same = {(w.shape[0], w.shape[1]) for w in weights if w.dtype == wdtype}
            tile_gemm.warmup(same, wdtype, self.device)
            if wdtype.itemsize > 1:
                if m_values:
                    skinny.warmup(same, self.model.dtype, self.device, m_values=m_values)
                continue
            for shape, w8a8, ms in self._fp8_sizes(same, wdtype):
                skinny.warmup([shape], self.model.dtype, self.device, m_values=ms,
                              weight_dtype=wdtype, w8a8=w8a8)

    def _fp8_sizes(self, shapes: set[tuple[int, int]], wdtype: torch.dtype
                   ) -> list[tuple[tuple[int, int], bool, list[int]]]:
        """The captured sizes each FP8 projection shape sends to the skinny kernel, by loop:
        (shape, W8A8, sizes), as `model.quant.fp8` routes them (past 16 rows only shapes with a
        tuned entry, so the table must be loaded first)."""
        from phaseflip.model.quant import fp8

        out = []
        for n, k in sorted(shapes):
            w = torch.empty(n, k, dtype=wdtype, device="meta")  # (its shape and dtype only)
            by_mode: dict[bool, list[int]] = {}
            for b in self.sizes:
                x = torch.empty(b, k, dtype=self.model.dtype, device=self.device)
                if fp8.skinny_rows(x, w):
                    by_mode.setdefault(not fp8.weight_only(x, w), []).append(b)
            out += [((n, k), w8a8, ms) for w8a8, ms in sorted(by_mode.items())]
        return out

    @torch.inference_mode()
    def prepare(self) -> None:
        """What every capture needs: the rope table at full length, the skinny GEMMs compiled
        with their workspace sized, the graphs' memory pool and capture stream. Sizes are then
        captured all at once (`capture`) or each on its first replay (`replay`)."""
        self.model.rope.ensure_capacity(self.max_context)
        self._rope_table = self.model.rope.cos_cache  # the table the graphs will read
        self._warm_linears()
        if self.record:
            self._mempool = torch.cuda.graph_pool_handle()
            index = torch.device(self.device).index
            self._side = capture_stream(torch.cuda.current_device() if index is None else index)
        self.addresses = self.addresses_with(self.pool, self.model.layout.tp_comm)

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The stream these graphs capture on (None until `prepare`, and when not recording):
        other captures of the rank share it, and with it cuBLAS' workspace."""
        return self._side

    # ------------------------------------------------------------------ parking
    def _statics(self) -> list[torch.Tensor]:
        """The static buffers the graphs read and write (theirs, kept with them)."""
        return [t for t in (self.input_ids, self.positions, self.out_cache_loc, self.kv_indptr,
                            self.kv_indices, self.rows, self.in_hidden, self.in_residual,
                            self.logits_out) if t is not None]

    def addresses_with(self, pool: KVPool, comm: object) -> dict[str, object]:
        """Every address a capture over `pool` and `comm` records that these graphs do not
        own: the model's parameters and buffers, its rope tables, the KV pool and its FP8
        scales, the communicator; and the static buffers. Cheap: pointers and shapes."""
        model = self.model
        out: dict[str, object] = {f"weight {n}": _address(t)
                                  for n, t in model.named_parameters()}
        out.update((f"buffer {n}", _address(t)) for n, t in model.named_buffers())
        out["rope tables"] = (_address(model.rope.cos_cache), _address(model.rope.sin_cache))
        out["KV pool"] = _address(pool.kv)
        out["KV scales"] = (_address(pool.k_scale), _address(pool.v_scale))
        out["communicator"] = _comm_address(comm)
        out["static buffers"] = tuple(_address(t) for t in self._statics())
        return out

    def adopt(self, pool: KVPool, comm: object) -> list[str]:
        """Takes these parked graphs into a new build of their layout over `pool` (its KV
        pool, a new view of the same arena) and `comm` (its TP communicator). Returns what
        moved since the captures (empty: adopted; replays are valid as they were). Else the
        caller must `release` these graphs and capture anew. An FP8 pool's scales are the
        ones the graphs read: the new pool's values are copied into them."""
        old = self.pool
        if (old.k_scale is not None and pool.k_scale is not None
                and old.k_scale.shape == pool.k_scale.shape):
            old.k_scale.copy_(pool.k_scale)
            old.v_scale.copy_(pool.v_scale)
            pool.k_scale, pool.v_scale = old.k_scale, old.v_scale
        now = self.addresses_with(pool, comm)
        was = self.addresses or {}
        moved = [k for k in sorted(now.keys() | was.keys()) if now.get(k) != was.get(k)]
        if moved:
            return moved
        self.pool = pool
        if len(self.graphs) < len(self.sizes):  # sizes left to capture on first use:
            self._warm_linears()  # the GEMM workspace may be a new one since
        return []

    def device_bytes(self) -> tuple[int, int | None]:
        """(allocated, reserved) device bytes these graphs keep while they exist: their
        static buffers, plus the blocks of their private memory pool in use (allocated) or
        held (reserved; None when the allocator's snapshot cannot be read)."""
        static = sum(t.numel() * t.element_size() for t in self._statics())
        if self._mempool is None:  # nothing recorded: no private pool
            return static, static
        try:
            pool_id = tuple(self._mempool)
            segments = [seg for seg in torch.cuda.memory_snapshot()
                        if tuple(seg.get("segment_pool_id", ())) == pool_id]
        except (RuntimeError, AttributeError, TypeError) as e:
            log.warning("decode graphs' memory pool unreadable (%s): reserved unmeasured", e)
            return static, None
        used = sum(seg["allocated_size"] for seg in segments)
        return static + used, static + sum(seg["total_size"] for seg in segments)

    def capture(self) -> None:
        """Captures every size (largest first: the smaller ones reuse its pool memory)."""
        self.prepare()
        for bs in tqdm(sorted(self.sizes, reverse=True), desc="capturing CUDA graphs",
                       unit="graph", leave=False, disable=not self.record):
            self._capture_one(bs)
        log.info("captured CUDA graphs for decode batch sizes %s", self.sizes)

    @torch.inference_mode()
    def _capture_one(self, bs: int) -> None:
        """Captures one size over the padding batch in the static buffers. Every TP rank
        captures a size at the same step (they replay the same plans), so the all-reduces
        inside the captures pair up."""
        batch = self._static_batch(bs)
        if not self.record:
            self.graphs[bs] = _Captured(batch, None, None, None, None, None)
            return
        self._keep_gemm_workspace()
        side = self._side
        torch.cuda.synchronize(self.device)
        state = self.backend.bind_graph_batch(batch, self.max_context)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile/autotune outside the capture
                self._run(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls (the NCCL watchdog querying its events,
        # HiCache copies) may not invalidate this capture; nor may a collector pass of this
        # thread that frees an older graph (`collector_paused`)
        with collector_paused(), torch.cuda.graph(graph, pool=self._mempool, stream=side,
                                                  capture_error_mode="thread_local"):
            hidden, residual, logits = self._run(batch)
        self.graphs[bs] = _Captured(batch, graph, hidden, residual, logits, state)
        torch.cuda.synchronize(self.device)

    def _keep_gemm_workspace(self) -> None:
        """Holds the split-K workspace this capture addresses: a parked graph outlives the
        runners whose holds keep the device's workspace (`kernels/linear.py`), and the next
        layout may start a new one."""
        if self.device.type != "cuda":
            return
        from phaseflip.kernels import linear

        ws = linear.workspace_for(self.device)
        if all(ws is not kept for kept in self._gemm_workspaces):
            self._gemm_workspaces.append(ws)

    def release(self) -> None:
        """Frees the graphs. Under TP this must happen before the NCCL communicator is
        destroyed: a communicator whose collectives live on in a captured graph does not
        finish its teardown (seen on the H200 pair: shutdown hung)."""
        for captured in self.graphs.values():
            if captured.graph is not None:
                captured.graph.reset()
        self.graphs.clear()
        self._gemm_workspaces.clear()

    # ------------------------------------------------------------------ replay
    def can_run(self, plan: ForwardBatch) -> bool:
        b = plan.batch_size
        if not 0 < b <= self.max_bs or plan.max_position >= self.max_context:
            return False
        if self.model.rope.cos_cache is not self._rope_table:  # regrown since: stale address
            return False
        pad = self.sizes[bisect.bisect_left(self.sizes, b)] - b
        return plan.is_decode and plan.kv_indices.numel() + pad <= self.kv_indices.numel()

    def replay(self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, future: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's outputs, as `LlamaForCausalLM.forward` returns them: on the last stage the
        final-normed states of `plan.logits_indices`. Views valid until the next replay. `plan`
        may live on the host; its tensors, and a later stage's `hidden`/`residual` input, are
        copied into the static buffers. `future`: the previous step's sampled tokens on the
        device, written over the plan's placeholders (`ForwardBatch.fill_future`) straight
        into the static ids, so a run-ahead step moves no other copy of its plan."""
        captured, plan = self._replay(plan, hidden, residual, future)
        b = plan.batch_size
        if captured.residual is not None:  # not the last stage: every row travels on
            return captured.hidden[:b], captured.residual[:b]
        return self._rows(plan, captured.hidden, b), None

    def replay_logits(self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None,
                      future: torch.Tensor | None = None) -> torch.Tensor | None:
        """The last stage's replay up to the logits: float32 `[len(plan.logits_indices), vocab]`
        on TP rank 0, None on the other TP ranks (they sent their shards inside the graph).
        Rows of the shared logits buffer, valid until the next replay (arguments as in
        `replay`)."""
        if not self.with_logits:
            raise ValueError("only the last pipeline stage's graphs compute logits")
        captured, plan = self._replay(plan, hidden, residual, future)
        b = plan.batch_size
        return None if captured.logits is None else self._rows(plan, captured.logits, b)

    def _rows(self, plan: ForwardBatch, out: torch.Tensor, b: int) -> torch.Tensor:
        """The rows of `plan.logits_indices` among the first `b` of a last stage's output."""
        if plan.logits_indices.numel() == b:  # one token per sequence: every row, in order
            return out[:b]
        rows = plan.logits_indices.to(self.device, non_blocking=True)  # pinned by _replay
        return out[:b].index_select(0, rows)

    def _replay(self, plan: ForwardBatch, hidden: torch.Tensor | None,
                residual: torch.Tensor | None, future: torch.Tensor | None
                ) -> tuple[_Captured, ForwardBatch]:
        """Fills the static buffers from `plan` (padded to the captured size) and replays that
        size's graph (eagerly when not recorded): (its capture, the plan as read: pinned when
        on the host of a GPU)."""
        b = plan.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        if bs not in self.graphs:  # captured on first use (a phase flip's new layout)
            self._reset_buffers()
            self._capture_one(bs)
        if self.in_hidden is not None:
            self.in_hidden[:b].copy_(hidden)
            self.in_residual[:b].copy_(residual)
            # the fused add-norm updates the residual in place: padding rows left as they are
            # would accumulate across replays (toward inf in fp16)
            self.in_hidden[b:bs].zero_()
            self.in_residual[b:bs].zero_()
        if self.device.type == "cuda":
            plan = plan.pinned()  # host tensors copy without waiting on the stream
        n = plan.kv_indices.numel()
        self.input_ids[:b].copy_(plan.input_ids, non_blocking=True)
        if future is not None:
            plan.fill_future(self.input_ids[:b], future)
        self.positions[:b].copy_(plan.positions, non_blocking=True)
        self.out_cache_loc[:b].copy_(plan.out_cache_loc, non_blocking=True)
        self.kv_indices[:n].copy_(plan.kv_indices, non_blocking=True)
        self.kv_indptr[: b + 1].copy_(plan.kv_indptr, non_blocking=True)
        if bs > b:  # padding rows: one key each, at slot 0, after the real contexts
            pad = bs - b
            # on the device (no host read of a plan that may already live there)
            torch.add(self.rows[1 : pad + 1], n, out=self.kv_indptr[b + 1 : bs + 1])
            self.out_cache_loc[b:bs].fill_(PAD_SLOT)
            self.kv_indices[n : n + pad].fill_(PAD_SLOT)
            self.positions[b:bs].zero_()
        captured = self.graphs[bs]
        if captured.graph is None:
            batch = captured.batch
            with torch.inference_mode():
                if self.backend.graph_capturable:
                    self.backend.bind_graph_batch(batch, self.max_context)
                else:  # the reference attention reads each prefix length on the host
                    lens = self.kv_indptr[1 : bs + 1] - self.kv_indptr[:bs]
                    batch = dataclasses.replace(batch, prefix_lens=(lens - 1).tolist())
                out, res, logits = self._run(batch)
            captured = dataclasses.replace(captured, hidden=out, residual=res, logits=logits)
        else:
            captured.graph.replay()
        return captured, plan
