"""Builds the model on its device, loads its weights, sizes the KV pool and runs forward plans."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from phaseflip.attention.torch_ref import TorchRefAttention
from phaseflip.cache.kv_pool import KVPool
from phaseflip.config import EngineConfig
from phaseflip.errors import CapacityError
from phaseflip.forward_batch import ForwardBatch
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.weight_image import WeightImage, load_model_weights

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


class ModelRunner:
    """One rank's model shard and KV pool. In a group every rank must use the same slot space:
    `agree_slots(local_slots)` returns the size all ranks agreed on (the minimum). `weights`:
    the host weight image to load from instead of the checkpoint (a phase flip's new ranks)."""

    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, layout: Layout | None = None,
                 device: torch.device | None = None,
                 agree_slots: Callable[[int], int] | None = None,
                 weights: WeightImage | None = None):
        self.cfg, self.model_cfg = cfg, model_cfg
        self.layout = layout or Layout()
        self.device = device or resolve_device(cfg.device)
        self.dtype = resolve_dtype(cfg.dtype, model_cfg, self.device)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_cfg, self.layout, self.dtype)
        # one load path: dummy init, the checkpoint, or the host image a phase flip's ranks
        # copy their shards from (`weights`); timed (`WeightsLoad`, the seam census reads it)
        self.weights_load = load_model_weights(self.model, cfg, model_cfg.model_dir,
                                               self.device, weights)
        log.info("tp rank %d, stage %d: %s", self.layout.tp_rank, self.layout.pp_rank,
                 self.weights_load.line())
        self.model.eval()
        self.backend = make_attention_backend(cfg.attention_backend, self.device)
        local = self._kv_slots()
        self.num_slots = agree_slots(local) if agree_slots else local
        n_layers = self.model.end_layer - self.model.start_layer
        kv_heads = self.model.layers[0].self_attn.num_kv_heads if n_layers else 0
        self.pool = KVPool(
            self.num_slots, (self.model.start_layer, self.model.end_layer), kv_heads,
            model_cfg.head_dim, self.dtype, self.device,
        )
        log.info("KV pool: %d slots on %s (%s)", self.num_slots, self.device, self.dtype)
        self.graphs = self._capture_graphs()

    def _capture_graphs(self):
        """Decode CUDA graphs of this rank's stage. TP collectives are captured with the layers
        when they run on NCCL; a TP group on gloo staging through the host (several ranks on one
        GPU, for correctness runs) cannot be captured and runs eagerly."""
        cfg = self.cfg
        if (self.device.type != "cuda" or cfg.disable_cuda_graph
                or not self.backend.graph_capturable
                or getattr(self.layout.tp_comm, "staged", False)):
            return None
        from phaseflip.model.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(
            self.model, self.pool, self.backend,
            max_bs=min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
            max_context=cfg.max_model_len or self.model_cfg.max_position_embeddings,
            max_kv_tokens=self.num_slots,
        )
        graphs.capture()
        return graphs

    def release_graphs(self) -> None:
        """Frees the decode graphs (before the rank's process group is destroyed)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            torch.cuda.synchronize(self.device)

    def free_device_memory(self) -> None:
        """Frees this rank's weights and KV pool in place, after its graphs were released (a
        flip's teardown): the storage goes even if something still refers to this runner,
        its model or its pool, so the next layout's ranks size their pools from the memory
        really free. The runner cannot run afterwards."""
        if self.graphs is not None:
            raise RuntimeError("release the decode graphs first (they address this memory)")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing queued may still read it
        self.pool.release()
        for t in [*self.model.parameters(), *self.model.buffers()]:
            t.untyped_storage().resize_(0)  # views of it (fused weights, caches) included

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
        budget = free - total * (1.0 - self.cfg.mem_fraction)
        m = self.model_cfg
        kv_heads = self.model.layers[0].self_attn.num_kv_heads
        n_layers = self.model.end_layer - self.model.start_layer
        per_token = KVPool.bytes_per_slot(n_layers, kv_heads, m.head_dim, self.dtype)
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
        """float32 logits [len(plan.logits_indices), vocab] (single-stage layouts). `future`:
        the previous step's sampled tokens on the device, which placeholder ids name."""
        if future is not None and plan.future_pos is not None and self.graphs is not None \
                and self.graphs.can_run(plan):
            hidden, _ = self.graphs.replay(plan, future=future)  # host plan, ids filled there
            return self.logits(hidden)
        if future is not None:
            plan = plan.to(self.device).with_future_tokens(future)
        hidden, _ = self.run_stage(plan)
        return self.logits(hidden)

    @torch.inference_mode()
    def run_stage(
        self, plan: ForwardBatch, hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's layers (see LlamaForCausalLM.forward): a decode plan the captured graphs
        can hold is replayed, anything else runs eagerly. `plan` may live on the host."""
        if self.graphs is not None and self.graphs.can_run(plan):
            return self.graphs.replay(plan, hidden, residual)
        return self.model(plan.to(self.device), self.pool, self.backend, hidden, residual)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:
            return torch.empty(0, self.model_cfg.vocab_size, device=self.device)
        return self.model.compute_logits(hidden)
