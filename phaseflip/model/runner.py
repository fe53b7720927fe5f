"""Builds the model on its device, loads its weights, sizes the KV pool and runs forward plans.

`Runner` is what the engine needs of whatever executes its plans: `ModelRunner` (this process,
one rank) and `distributed.driver.DistributedRunner` (a TP/PP group, seen from rank 0) both
implement it, with one `forward` signature.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from phaseflip.attention.torch_ref import TorchRefAttention
from phaseflip.cache.hicache.frames import HostFrames
from phaseflip.cache.hicache.page import PageGeometry
from phaseflip.cache.hicache.transfer import (
    KVTransferEngine,
    LocalChannel,
    RankSlice,
    TransferChannel,
)
from phaseflip.cache.kv_pool import KVArena, KVPool, kv_cache_dtype
from phaseflip.config import EngineConfig
from phaseflip.errors import CapacityError
from phaseflip.forward_batch import ForwardBatch
from phaseflip.layout import Layout, ProcessGroupCommunicator
from phaseflip.model.config import ModelConfig
from phaseflip.model.layers import HAS_TRITON
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.quant import engine_quantization
from phaseflip.model.quant.kv_scales import load_kv_scales
from phaseflip.model.weight_image import WeightImage, WeightsLoad, load_model_weights

if TYPE_CHECKING:
    from phaseflip.model.cuda_graph import DecodeGraphs, GraphReuse
    from phaseflip.model.piecewise_graph import PiecewiseGraphs

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_TOKENS = 16384


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CapacityError("device=cuda was asked for but no CUDA device is available")
    return device


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU half-precision matmuls are slow and a poor oracle
    return model_cfg.dtype if model_cfg.dtype != torch.float32 else torch.bfloat16


def make_attention_backend(name: str, device: torch.device):
    """The attention backend by name; auto = Triton kernels on CUDA when Triton imports."""
    if name == "auto":
        name = "torch"
        if device.type == "cuda":
            try:
                import triton  # noqa: F401

                name = "triton"
            except ImportError:
                log.warning("triton is not installed: using the slow reference attention")
    if name == "triton":
        if device.type != "cuda":
            raise CapacityError("attention_backend=triton needs a CUDA device")
        from phaseflip.attention.triton_backend import TritonAttention

        return TritonAttention()
    return TorchRefAttention()


def _gemm_workspace(device: torch.device, hold: bool) -> bool:
    """Takes (or lets go of) a hold on the skinny GEMM's split-K workspace of `device`, which
    decode graphs capture (`kernels/linear_workspace.py`). True if there is one to hold."""
    if device.type != "cuda" or not HAS_TRITON:
        return False
    from phaseflip.kernels import linear_workspace as ws  # (imports triton)

    (ws.hold_workspace if hold else ws.release_workspace)(device)
    return True


def free_model(model: torch.nn.Module) -> None:
    """Frees a model's parameters and buffers in place: their storage goes even if something
    still refers to them (views included: fused weights, caches)."""
    for t in [*model.parameters(), *model.buffers()]:
        t.untyped_storage().resize_(0)


class Runner(Protocol):
    """The ranks that execute the scheduler's plans, as the engine sees them (rank 0)."""

    closed: bool  # after `close` (or a group stop): it cannot run again

    @property
    def num_slots(self) -> int: ...  # the KV slot space every rank shares (law 2)

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def weights_load(self) -> WeightsLoad: ...  # how rank 0 got its weights, timed

    @property
    def build_s(self) -> dict[str, float]: ...  # rank 0's build of its layout, by part

    @property
    def graphs(self) -> object | None: ...  # rank 0's decode graphs, None when eager

    @property
    def graph_capture(self) -> str | None: ...  # "at build", "on first use", "parked"; None: eager

    @property
    def graphs_kept_bytes(self) -> int | None: ...  # rank 0's parked graphs, reserved bytes

    @property
    def numerics(self) -> dict[str, str | None]: ...  # dtypes and quantization, as run

    def forward(self, plan: ForwardBatch, future: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [len(plan.logits_indices), vocab]. `future`: the previous step's
        sampled tokens on the device, which placeholder ids in `plan` name (overlap; one
        process only)."""
        ...

    def transfer_channel(self, frames: HostFrames, geometry: PageGeometry) -> TransferChannel:
        """HiCache's copy channel between `frames` (the host tier) and every rank's pool."""
        ...

    def check_alive(self) -> None:
        """Raises if a rank has died (the group is then stopped)."""
        ...

    def close(self) -> None:
        """Stops the ranks and frees their device memory (graphs, weights, KV pool) in place,
        even if something still refers to them. Idempotent."""
        ...


class ModelRunner:
    """One rank's model shard and KV pool. In a group every rank must use the same slot space:
    `agree_slots(local_slots)` returns the size all ranks agreed on (the minimum). `weights`:
    the host weight image to load from instead of the checkpoint (a phase flip's new ranks).
    `before_sizing`: called once the weights are loaded, before the KV pool is sized from free
    memory (a group's barrier: every rank's weights are in, every old layout is gone);
    `device_share`: how many ranks share this device, each sized to its part of the budget.
    `resident`: this layout's model, weights loaded, parked on the device by an earlier build
    (the dual-resident flip strategy): nothing is loaded. `lazy_graphs`: decode graphs are
    captured each on its first use instead of all at build (a phase flip's seam).
    `weights_from`: fills the new (empty) model instead of the checkpoint (the peer strategy:
    slices kept from the old layout and received from the other ranks). `kv_arena`: the
    rank's KV arena (flips but peer's): the pool lives in it, and once it holds memory the
    pool takes as many slots as fit in it instead of sizing itself from what is free; the
    build that reserves it leaves the arena's `headroom` out of the budget it reads.
    `graph_reuse`: this layout's decode graphs parked at its last seam (resident weights),
    adopted if every address they captured is unchanged on every rank."""

    graphs_kept_bytes: int | None = None  # set by the rank: its parked graphs' reserved bytes

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, layout: Layout | None = None,
                 device: torch.device | None = None,
                 agree_slots: Callable[[int], int] | None = None,
                 weights: WeightImage | None = None,
                 before_sizing: Callable[[], None] | None = None, device_share: int = 1,
                 resident: LlamaForCausalLM | None = None, lazy_graphs: bool = False,
                 weights_from: Callable[[LlamaForCausalLM], WeightsLoad] | None = None,
                 kv_arena: KVArena | None = None, graph_reuse: GraphReuse | None = None):
        t0 = time.perf_counter()
        self.cfg, self.model_cfg = cfg, model_cfg
        self.layout = layout or Layout()
        self.device = device or resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.dtype)  # FP8 KV: 2x tokens
        self.quant = engine_quantization(cfg, model_cfg.model_dir)  # FP8 weights, or None
        self.model, self.weights_load = self._load_model(resident, weights_from, weights)
        log.info("tp rank %d, stage %d: %s", self.layout.tp_rank, self.layout.pp_rank,
                 self.weights_load.line())
        self.model.eval()
        self.backend = make_attention_backend(cfg.attention_backend, self.device)
        t_weights = time.perf_counter()
        if self.device.type == "cuda":
            # blocks this rank cached but no longer uses count as free for the pool's sizing
            torch.cuda.empty_cache()
        if before_sizing is not None:
            before_sizing()
        self.device_share = device_share
        t_sizing = time.perf_counter()
        self.pool = self._build_pool(kv_arena, agree_slots)
        self._workspace_held = _gemm_workspace(self.device, hold=True)
        t_pool = time.perf_counter()
        # how the decode graphs came: None (eager), "at build", "on first use", "parked"
        self.graphs, self.graph_capture = self._capture_graphs(lazy_graphs, graph_reuse)
        self.pieces = self._capture_pieces() if self.graph_capture == "at build" else None
        if self.layout.is_last_stage and self.graph_capture == "at build":
            # an eager step's LM head meets no new cuBLAS kernel (`lm_head.ParallelLMHead`);
            # a flip's new layout skips it: its first uses would lengthen the seam
            self.model.lm_head.warm(cfg.max_running_requests)
        # how long building this rank took, by part (a flip's census reads rank 0's)
        self.build_s = {"weights": t_weights - t0, "wait_for_ranks": t_sizing - t_weights,
                        "kv_pool": t_pool - t_sizing, "graphs": time.perf_counter() - t_pool}
        self.closed = False

    def _load_model(self, resident: LlamaForCausalLM | None,
                    weights_from: Callable[[LlamaForCausalLM], WeightsLoad] | None,
                    weights: WeightImage | None) -> tuple[LlamaForCausalLM, WeightsLoad]:
        """This rank's shard and how it came: parked on the device at launch (`resident`), or
        built here and filled by one load path — dummy init, the checkpoint, or the host image
        a phase flip's ranks copy their shards from (`weights`); timed (the census's)."""
        if resident is not None:
            return resident, WeightsLoad("resident", 0.0, bytes_moved=0)
        with torch.device(self.device):
            model = LlamaForCausalLM(self.model_cfg, self.layout, self.dtype, self.quant)
        load = (weights_from(model) if weights_from is not None else
                load_model_weights(model, self.cfg, self.model_cfg.model_dir, self.device,
                                   weights))
        if model.layout.is_last_stage:
            model.lm_head.quantize_()  # the FP8 LM head's copy (`--fp8-lm-head`), else nothing
        return model, load

    def _build_pool(self, kv_arena: KVArena | None,
                    agree_slots: Callable[[int], int] | None) -> KVPool:
        """The KV pool: this rank's slots from its arena (reserved at launch) or from free
        memory, agreed over the ranks (`agree_slots`: the smallest); sets `num_slots` and
        `kv_headroom` (what the arena's first build leaves a later layout's larger shard)."""
        cfg, model = self.cfg, self.model
        n_layers = model.end_layer - model.start_layer
        kv_heads = model.layers[0].self_attn.num_kv_heads if n_layers else 0
        per_slot = KVPool.bytes_per_slot(n_layers, kv_heads, self.model_cfg.head_dim,
                                         self.kv_dtype)
        self.kv_headroom = (kv_arena.headroom if kv_arena is not None and not kv_arena.nbytes
                            else 0)
        if kv_arena is not None and kv_arena.nbytes and cfg.max_total_tokens is None:
            ps = cfg.page_size  # the rank's budget, reserved at launch, in this layout's slots
            local = kv_arena.nbytes // per_slot // ps * ps
        else:  # from free memory, or the cap (which reads none)
            local = self._kv_slots()
        if kv_arena is not None:  # this rank's own slots, not the agreed (smaller) count
            kv_arena.reserve(local * per_slot, self.device)
        self.num_slots = agree_slots(local) if agree_slots else local
        pool = KVPool(self.num_slots, (model.start_layer, model.end_layer), kv_heads,
                      self.model_cfg.head_dim, self.kv_dtype, self.device, arena=kv_arena)
        load_kv_scales(pool, model, self.model_cfg.model_dir, cfg.load_format)  # FP8
        log.info("KV pool: %d slots on %s (%s)", self.num_slots, self.device, self.kv_dtype)
        return pool

    @property
    def numerics(self) -> dict[str, str | None]:
        """What the weights and the KV cache run in (a pre-quantized FP8 checkpoint runs FP8
        without --quantization: this says so)."""
        return {"dtype": str(self.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "quantization": None if self.quant is None else f"fp8 ({self.quant.source})"}

    def _capture_graphs(self, lazy: bool, reuse: GraphReuse | None
                        ) -> tuple[DecodeGraphs | None, str | None]:
        """Decode CUDA graphs of this rank's stage and how they came: the parked ones of
        `reuse` if valid, else new ones (`lazy`: prepared, each size captured on its first
        replay). TP collectives are captured with the layers when they run on NCCL; a TP
        group on gloo staging through the host (several ranks on one GPU, for correctness
        runs) cannot be captured and runs eagerly. CPU runners get unrecorded graphs when
        the tests ask (`UNRECORDED_ENV`)."""
        from phaseflip.model.cuda_graph import UNRECORDED_ENV, DecodeGraphs

        cfg = self.cfg
        unrecorded = self.device.type != "cuda" and os.environ.get(UNRECORDED_ENV) == "1"
        usable = not cfg.disable_cuda_graph and (unrecorded or (
            self.device.type == "cuda" and self.backend.graph_capturable
            and not (isinstance(self.layout.tp_comm, ProcessGroupCommunicator)
                     and self.layout.tp_comm.staged)))
        how = "on first use" if lazy else "at build"
        if reuse is not None:  # every rank of the group votes, with parked graphs or not
            moved = (reuse.parked.adopt(self.pool, self.layout.tp_comm)
                     if reuse.parked is not None and usable else ["nothing parked"])
            if reuse.agree(not moved):
                return reuse.parked, "parked"
            if reuse.parked is not None:
                reuse.parked.release()
                log.warning("tp rank %d, stage %d: the decode graphs parked with this layout "
                            "are stale (moved: %s); capturing each size on first use",
                            self.layout.tp_rank, self.layout.pp_rank,
                            ", ".join(moved[:3]) or "on another rank")
                how = "on first use (parked stale)"
        if not usable:
            return None, None
        graphs = DecodeGraphs(
            self.model, self.pool, self.backend,
            max_bs=min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
            max_context=cfg.context_len(self.model_cfg.max_position_embeddings),
            max_kv_tokens=self.num_slots, record=not unrecorded,
        )
        if lazy:
            graphs.prepare()
        else:
            graphs.capture()
        return graphs, how

    def _capture_pieces(self) -> PiecewiseGraphs | None:
        """Piecewise graphs for prefill and mixed steps (`model/piecewise_graph.py`) when
        the decode graphs were captured at build (unrecorded ones give unrecorded pieces: CPU
        tests) and `piecewise_graph_max_tokens` > 0; else None (those steps run eagerly).
        Every rank of a layout decides alike, so TP ranks capture in lockstep."""
        from phaseflip.model.piecewise_graph import PiecewiseGraphs

        cfg, graphs = self.cfg, self.graphs
        if cfg.piecewise_graph_max_tokens < 1 or graphs is None:
            return None
        pieces = PiecewiseGraphs(
            self.model, self.pool, self.backend, max_tokens=cfg.piecewise_graph_max_tokens,
            max_context=graphs.max_context, record=graphs.record)
        pieces.capture(graphs.side_stream)
        return pieces

    def _release_pieces(self) -> None:
        if self.pieces is not None:
            self.pieces.release()
            self.pieces = None

    def _eager_stage(self, plan: ForwardBatch, hidden: torch.Tensor | None,
                     residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The stage's forward for a plan no decode graph holds: its layers replayed from
        piecewise graphs around eager attention when they hold it, else all eager."""
        plan = plan.to(self.device)
        if self.pieces is not None and self.pieces.can_run(plan):
            out, res = self.pieces.run(plan, hidden, residual)
            if not self.layout.is_last_stage:
                return out, res
            return self.model.final_states(out, res, plan.logits_indices), None
        return self.model(plan, self.pool, self.backend, hidden, residual)

    def park_graphs(self) -> DecodeGraphs | None:
        """Hands this runner's decode graphs over whole, unreleased, to be parked with its
        layout's model (resident weights); `free_device_memory` may follow. Piecewise
        graphs are not parked: they are released (a later build of the layout runs those
        steps eagerly)."""
        self._release_pieces()
        graphs, self.graphs = self.graphs, None
        return graphs

    def release_graphs(self) -> None:
        """Frees the decode and piecewise graphs (before the rank's process group is
        destroyed)."""
        self._release_pieces()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            if self.device.type == "cuda":  # (unrecorded graphs on a CPU: tests)
                torch.cuda.synchronize(self.device)

    def free_device_memory(self, keep_weights: bool = False,
                           graphs_parked: bool = False) -> LlamaForCausalLM | None:
        """Frees this rank's KV pool and (unless `keep_weights`) its weights in place, after
        its graphs were released (a flip's teardown): the storage goes even if something
        still refers to this runner, its model or its pool, so the next layout's ranks size
        their pools from the memory really free — except a pool in the rank's KV arena, whose
        memory the next layout's pool reuses (a stale view would then read its rows). The
        runner cannot run afterwards.
        `keep_weights`: the model is returned whole, to be parked (resident weights).
        `graphs_parked`: decode graphs parked on this rank may address cuBLAS workspaces: they
        are kept."""
        if self.graphs is not None or self.pieces is not None:
            raise RuntimeError("release the decode graphs first (they address this memory)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing queued may still read it
        self.pool.release()
        model = self.model if keep_weights else None
        if model is None:
            free_model(self.model)
        if self._workspace_held:  # the last holder frees it (its graphs are gone)
            self._workspace_held = not _gemm_workspace(self.device, hold=False)
        if (self.device.type == "cuda" and not graphs_parked
                and hasattr(torch._C, "_cuda_clearCublasWorkspaces")):
            # cuBLAS keeps a workspace per stream it ran on (32 MiB on the H200), the graph
            # capture's side stream included: without this each layout leaked one
            torch._C._cuda_clearCublasWorkspaces()
        return model

    def check_alive(self) -> None:
        """One process: no rank can die apart from this one."""

    def transfer_channel(self, frames: HostFrames, geometry: PageGeometry) -> TransferChannel:
        """Copies between `frames` and this pool on a local transfer engine (every layer and
        KV head: one process holds them all)."""
        part = RankSlice(range(geometry.num_layers), range(geometry.num_kv_heads))
        return LocalChannel(KVTransferEngine(self.pool, frames, geometry, part, self.device))

    def close(self) -> None:
        """Frees the graphs, then the weights, the KV pool and this runner's hold on the GEMM
        workspace (`free_device_memory`). The runner cannot run afterwards."""
        if self.closed:
            return
        self.closed = True
        self.release_graphs()
        self.free_device_memory()

    def _kv_slots(self) -> int:
        """Usable KV tokens plus the reserved padding page, rounded to whole pages."""
        ps = self.cfg.page_size
        if self.cfg.max_total_tokens is not None:
            tokens = self.cfg.max_total_tokens
        elif self.device.type == "cpu":
            tokens = CPU_DEFAULT_KV_TOKENS
        else:
            tokens = self._tokens_from_memory()
        pages = -(-tokens // ps) + 1
        return pages * ps

    def _tokens_from_memory(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        headroom = self.kv_headroom
        budget = ((free - total * (1.0 - self.cfg.mem_fraction)) / self.device_share
                  - headroom)
        log.info("KV budget: %.2f GiB free of %.2f, %.2f GiB allocated and %.2f reserved here, "
                 "%d rank(s) on the device, %.2f GiB left for a later layout's larger shard: "
                 "%.2f GiB for this rank's pool", free / 2**30, total / 2**30,
                 torch.cuda.memory_allocated(self.device) / 2**30,
                 torch.cuda.memory_reserved(self.device) / 2**30, self.device_share,
                 headroom / 2**30, budget / 2**30)
        m = self.model_cfg
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        n_layers = self.model.end_layer - self.model.start_layer
        per_token = KVPool.bytes_per_slot(n_layers, kv_heads, m.head_dim, self.kv_dtype)
        tokens = int(budget // per_token)
        if tokens < 1024:
            raise CapacityError(
                f"only {budget / 2**30:.2f} GiB left for the KV cache ({tokens} tokens) after "
                f"loading weights; raise --mem-fraction (now {self.cfg.mem_fraction}) or use a "
                "smaller model"
            )
        return tokens

    @torch.inference_mode()
    def forward(self, plan: ForwardBatch, future: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [len(plan.logits_indices), vocab] (one process: every layer, no TP
        peers). `future`: the previous step's sampled tokens on the device, which placeholder
        ids name. From a decode graph they are valid until the next forward: the engine samples
        a step's logits before it launches the next."""
        if future is not None and plan.future_pos is not None and self.graphs is not None \
                and self.graphs.can_run(plan):
            return self.graphs.replay_logits(plan, future=future)  # host plan, ids filled there
        if future is not None:
            plan = plan.to(self.device).with_future_tokens(future)
        return self.stage_logits(plan)

    @torch.inference_mode()
    def run_stage(
        self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers (see LlamaForCausalLM.forward): a decode plan the captured graphs
        can hold is replayed, anything else runs eagerly. `plan` may live on the host."""
        if self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.replay(plan, hidden, residual)
        return self._eager_stage(plan, hidden, residual)

    @torch.inference_mode()
    def stage_logits(self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, keep: bool = False
                     ) -> torch.Tensor | None:
        """The last stage's layers and LM head: float32 logits of `plan.logits_indices` on the
        rank that samples (TP rank 0), None on the other TP ranks, which only send their
        vocabulary shard. A decode plan the captured graphs can hold replays one graph up to
        the logits, which are then rows of its static buffer, valid until the next replay;
        `keep` (a micro-batch with more to come) copies them out."""
        if self.graphs is not None and self.graphs.can_run(plan):
            logits = self.graphs.replay_logits(plan, hidden, residual)
            return logits.clone() if keep and logits is not None else logits
        out, _ = self._eager_stage(plan, hidden, residual)
        return self.logits(out)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The LM head over final-normed states: float32 logits on TP rank 0, else None."""
        if hidden.shape[0] == 0:  # every TP rank sees the same empty plan: no gather
            return (torch.empty(0, self.model_cfg.vocab_size, device=self.device)
                    if self.layout.tp_rank == 0 else None)
        return self.model.compute_logits(hidden)
