"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 (QKV bias) and Qwen3 (q/k norm).

One module serves them all; the differences are flags on `ModelConfig`. The model holds only
the layers of its pipeline stage and only its tensor-parallel shard of each (`Layout`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from phaseflip.attention import AttentionBackend
from phaseflip.cache.kv_pool import KVPool
from phaseflip.errors import ModelLoadError
from phaseflip.forward_batch import ForwardBatch
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
    default_weight_loader,
    folded_linear,
    folds_rows,
)
from phaseflip.model.lm_head import ParallelLMHead
from phaseflip.model.quant import Fp8Config, convert_checkpoint
from phaseflip.model.quant.fp8 import Fp8Activation, ScaledRows, output_rows
from phaseflip.model.rope import RotaryBatch, RotaryEmbedding

if TYPE_CHECKING:  # (imported on first use: it needs triton)
    from phaseflip.kernels.linear_fold import RotaryFold

log = logging.getLogger(__name__)

# checkpoint name fragment -> (fused parameter fragment, shard id)
_FUSED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, layout: Layout, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
            cfg.attention_bias, layout, dtype, quant,
        )
        self.o_proj = RowParallelLinear(
            cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, layout, dtype, quant
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_sliding_window(layer_id)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor | Fp8Activation,
        batch: ForwardBatch,
        rotary: RotaryBatch,
        pool: KVPool,
        backend: AttentionBackend,
        fold: bool = False,
    ) -> torch.Tensor | ScaledRows:
        """`fold`: o_proj's FP8 scales may be left to the residual add (`ScaledRows`)."""
        q, k, v = self.qkv_proj(x)
        return self.o_proj(self.attend(q, k, v, batch, rotary, pool, backend), fold=fold)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               rotary: RotaryBatch, pool: KVPool, backend: AttentionBackend, *,
               rotated: bool = False) -> torch.Tensor:
        """The attention output [T, heads * head_dim] (before o_proj) of projected q, k, v;
        `rotated`: q is rotated and the new K/V are in the pool already (`rotary_fold`)."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if not rotated:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            # one launch on CUDA: q rotated in place (a view of the qkv output), rotated k and
            # v written into the pool; k itself is then stale, the backend reads the pool
            q = rotary.rotate_and_store_(q, k, v, pool, self.layer_id, batch.out_cache_loc)
        return backend.forward(
            self.layer_id, q, k, v, batch, pool, self.scale, self.sliding_window, kv_stored=True
        )

    def rotary_fold(self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryBatch,
                    pool: KVPool) -> RotaryFold | None:
        """The rotary and KV store as qkv's epilogue (`kernels.linear_fold.RotaryFold`), for a
        folded layer (`folds_rows`) whose rotary runs as a kernel; None where q/k norms come
        between the projection and the rotary (Qwen3) or the rotary is partial."""
        rope = rotary.rope
        if self.q_norm is not None or rope.rotary_dim != self.head_dim or not rope.uses_kernel(x):
            return None
        from phaseflip.kernels.linear_fold import RotaryFold

        k_cache, v_cache = pool.layer(self.layer_id)
        k_scale, v_scale = pool.scales(self.layer_id) or (None, None)
        return RotaryFold(rotary.positions, rope.cos_cache, rope.sin_cache, batch.out_cache_loc,
                          k_cache, v_cache, k_scale, v_scale, self.num_heads)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: Layout, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], False, layout, dtype, quant
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, False, layout, dtype, quant)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor | Fp8Activation, fold: bool = False
                ) -> torch.Tensor | ScaledRows:
        """`fold`: down's FP8 scales may be left to the next residual add (`ScaledRows`)."""
        gate_up = self.gate_up_proj(x)
        # the SiLU kernel quantizes for `down` where that is bitwise what `down` would do
        quantize = self.down_proj.takes_fp8_input(gate_up[..., : gate_up.shape[-1] // 2])
        return self.down_proj(self.act(gate_up, quantize=quantize), fold=fold)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, layout: Layout, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, layout, dtype, quant)
        self.mlp = MLP(cfg, layout, dtype, quant)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x, residual, batch, rotary, pool, backend, fold_out: bool = False):
        """(hidden, residual) after the layer; `fold_out`: the hidden may be `ScaledRows`
        (down's FP8 product unscaled, for the next layer's residual add)."""
        if residual is None and folds_rows(x, self.self_attn.o_proj.layout, self._linears):
            return self._forward_folded(x, batch, rotary, pool, backend), None
        # each norm quantizes its output for the FP8 projection it feeds where that projection
        # would quantize it the same way itself (`takes_fp8_input`: shapes only, graph-safe)
        quantize = self.self_attn.qkv_proj.takes_fp8_input(output_rows(x))
        if residual is None:
            residual, x = x, self.input_layernorm(x, quantize=quantize)
        else:
            x, residual = self.input_layernorm(x, residual, quantize=quantize)
        # o and down may hand the residual adds their products unscaled (`ScaledRows`): the
        # add + norm kernel applies the scales, and cuBLAS runs tensor-wise (faster). A
        # single rank only: it rounds the product once more than row-wise, and the layouts a
        # flip moves between (tp, pp) must keep rounding alike
        layout = self.self_attn.o_proj.layout
        fold = layout.tp_size == 1 and layout.pp_size == 1
        x = self.self_attn(x, batch, rotary, pool, backend, fold=fold)
        quantize = self.mlp.gate_up_proj.takes_fp8_input(output_rows(x))
        x, residual = self.post_attention_layernorm(x, residual, quantize=quantize)
        return self.mlp(x, fold=fold and fold_out), residual

    @property
    def _linears(self) -> tuple[nn.Module, ...]:
        attn, mlp = self.self_attn, self.mlp
        return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj

    def _forward_folded(self, r: torch.Tensor, batch: ForwardBatch, rotary: RotaryBatch,
                        pool: KVPool, backend: AttentionBackend) -> torch.Tensor:
        """The layer for a few rows with its norms, SiLU·mul and residual adds inside the
        projections' launches (`kernels/linear_fold.py`): r is the residual stream in (hidden
        and residual summed: what the unfolded path calls residual with hidden None) and out."""
        attn, mlp = self.self_attn, self.mlp
        rot = attn.rotary_fold(r, batch, rotary, pool)
        qkv = folded_linear(r, attn.qkv_proj, norm=self.input_layernorm, rotary=rot)
        o = attn.attend(*attn.qkv_proj.split(qkv), batch, rotary, pool, backend,
                        rotated=rot is not None)
        r = folded_linear(o, attn.o_proj, residual=r)
        act = folded_linear(r, mlp.gate_up_proj, norm=self.post_attention_layernorm,
                            silu_mul=True)
        return folded_linear(act, mlp.down_proj, residual=r)


class LlamaForCausalLM(nn.Module):
    """Holds layers [start, end) of the stage; the first stage embeds, the last one norms and
    projects to logits. Between stages the (hidden, residual) pair is what travels. `quant`:
    FP8 decoder projections (`model.quant`), loaded from any FP8 or float checkpoint."""

    def __init__(self, cfg: ModelConfig, layout: Layout, dtype: torch.dtype,
                 quant: Fp8Config | None = None) -> None:
        super().__init__()
        self.cfg, self.layout, self.quant = cfg, layout, quant
        self.dtype = dtype  # the float dtype (FP8 projections aside)
        self.start_layer, self.end_layer = layout.layer_range(cfg.num_layers)
        if layout.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, layout, dtype
            )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, layout, dtype, quant)
            for i in range(self.start_layer, self.end_layer)
        )
        if layout.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, layout, dtype,
                                          fp8=quant is not None and quant.lm_head)
            if cfg.tie_word_embeddings and layout.is_first_stage:
                self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)

    def forward(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (hidden, residual) after this stage's layers; on the last stage `hidden` is
        the final-normed state of the rows named by `batch.logits_indices`."""
        hidden, residual = self.forward_layers(batch, pool, backend, hidden, residual)
        if not self.layout.is_last_stage:
            return hidden, residual
        return self.final_states(hidden, residual, batch.logits_indices), None

    def forward_layers(
        self,
        batch: ForwardBatch,
        pool: KVPool,
        backend: AttentionBackend,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) of every row after this stage's layers, before the final norm:
        what piecewise graphs capture (`model/piecewise_graph.py`)."""
        if self.layout.is_first_stage:
            hidden, residual = self.embed_tokens(batch.input_ids), None
        rotary = self.rope.for_batch(batch.positions, hidden.dtype, max_position=batch.max_position)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):  # what leaves the stage is a tensor
            hidden, residual = layer(hidden, residual, batch, rotary, pool, backend,
                                     fold_out=i < last)
        return hidden, residual

    def final_states(self, hidden: torch.Tensor, residual: torch.Tensor,
                     rows: torch.Tensor) -> torch.Tensor:
        """The last stage's final-normed states of `rows` (the rows logits are taken of);
        `residual` None: `hidden` is the residual stream (a folded step's layers)."""
        if residual is None:
            return self.norm(hidden[rows])
        return self.norm(hidden[rows], residual[rows])[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits on the sampling rank (TP rank 0), None on the other TP ranks."""
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Feeds every checkpoint tensor to the parameter that owns it (slicing its shard);
        raises naming any parameter the checkpoint did not provide."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        weights = self._checked_stream(weights)
        if self.quant is not None:  # any FP8 or float checkpoint -> FP8 weights + row scales
            weights = convert_checkpoint(weights, self.quant, next(self.parameters()).device,
                                         keep=lambda n: (t := self._param_name(n)) is not None
                                         and t[0] in params)
        for name, tensor in weights:
            target = self._param_name(name)
            if target is None:
                continue
            pname, shard = target
            if pname not in params:
                continue  # another stage's layer, or lm_head of a tied model
            param = params[pname]
            loader = getattr(param, "weight_loader", default_weight_loader)
            t = tensor.to(param.dtype)
            try:
                loader(param, t) if shard is None else loader(param, t, shard)
            except (ValueError, RuntimeError) as e:
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                raise ModelLoadError(f"cannot load checkpoint tensor '{name}' of shape "
                                     f"{tuple(tensor.shape)} into {pname}: {e}") from e
            loaded.add(pname if shard is None else f"{pname}#{shard}")
        self._check_complete(params, loaded)

    def _checked_stream(self, weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream, each tensor of the config's inventory checked against its full shape
        first: the loaders slice a rank's part, so a tensor too large would be cut and one
        too small zero-filled (the embedding) without a word (transformers refuses both).
        A tied model's lm_head.weight is not loaded (the embedding is the output projection,
        as in vLLM); where it differs from the embedding, a warning says so."""
        from phaseflip.model.dummy import checkpoint_shapes

        want = {n.removeprefix("model."): s for n, s in checkpoint_shapes(self.cfg)}
        tied = self.cfg.tie_word_embeddings
        rows = torch.linspace(0, self.cfg.vocab_size - 1, 16).long()
        samples: dict[str, torch.Tensor] = {}  # a few rows of the embedding and the head
        for name, tensor in weights:
            short = name.removeprefix("model.")
            shape = want.get(short)
            if shape is not None and tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    f"checkpoint tensor '{name}' has shape {tuple(tensor.shape)}, but config.json "
                    f"implies {shape} (in {self.cfg.model_dir})")
            if tied and short in ("embed_tokens.weight", "lm_head.weight") and tensor.dim() == 2:
                samples[short] = tensor[rows.to(tensor.device)].float().cpu()
            yield name, tensor
        if (len(samples) == 2 and not torch.equal(*samples.values())
                and self.layout.tp_rank == 0 and self.layout.is_last_stage):
            log.warning(
                "%s: config.json ties the word embeddings, but the checkpoint's lm_head.weight "
                "differs from its embed_tokens.weight: serving with the embedding as the output "
                "projection (as vLLM does; transformers 5 unties them and uses lm_head.weight). "
                "Set tie_word_embeddings to false in config.json to serve lm_head.weight",
                self.cfg.model_dir)

    def _param_name(self, name: str) -> tuple[str, str | int | None] | None:
        if "rotary_emb" in name:
            return None
        name = name.removeprefix("model.").replace(".weight_scale_inv", ".weight_scale")
        tied = self.cfg.tie_word_embeddings
        if name == "lm_head.weight" and tied:
            return None
        if name == "embed_tokens.weight" and tied and not self.layout.is_first_stage:
            return "lm_head.weight", None  # a last stage without the embedding shares its rows
        if not name.startswith("layers."):
            return name, None
        idx = int(name.split(".")[1])
        if not self.start_layer <= idx < self.end_layer:
            return None
        name = name.replace(f"layers.{idx}.", f"layers.{idx - self.start_layer}.", 1)
        for src, dst, shard in _FUSED:
            if f".{src}." in name:
                return name.replace(src, dst), shard
        return name, None

    def _checkpoint_name(self, entry: str) -> str:
        """The checkpoint tensor a `loaded` entry ("pname" or "pname#shard") stands for: the
        inverse of `_param_name` (global layer index, unfused projection, "model." prefix)."""
        pname, _, shard = entry.partition("#")
        if pname == "lm_head.weight":
            return "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else pname
        if pname.startswith("layers."):
            idx = int(pname.split(".")[1])
            pname = pname.replace(f"layers.{idx}.", f"layers.{idx + self.start_layer}.", 1)
        for src, dst, sid in _FUSED:
            if f".{dst}." in pname and str(sid) == shard:
                pname = pname.replace(dst, src)
        return f"model.{pname}"

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for pname in params:
            if "qkv_proj" in pname:
                need = [f"{pname}#{s}" for s in ("q", "k", "v")]
            elif "gate_up_proj" in pname:
                need = [f"{pname}#{s}" for s in (0, 1)]
            elif pname == "lm_head.weight" and "embed_tokens.weight" in params and (
                self.cfg.tie_word_embeddings
            ):
                need = []
            else:
                need = [pname]
            missing += [self._checkpoint_name(n) for n in need if n not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            hint = ("; config.json has tie_word_embeddings false: set it to true if the "
                    "embedding is the output projection" if "lm_head.weight" in missing else "")
            raise ModelLoadError(
                f"checkpoint in {self.cfg.model_dir} lacks {len(missing)} tensors: {shown}{hint}"
            )


def meta_shards(cfg: ModelConfig, tp_size: int, pp_size: int, dtype: torch.dtype,
                quant: Fp8Config | None = None) -> Iterator[LlamaForCausalLM]:
    """Every rank's model of a tp × pp layout (rank order: tp fastest) on the meta device:
    the shapes a layout allocates, nothing allocated or read."""
    for rank in range(tp_size * pp_size):
        layout = Layout(rank % tp_size, tp_size, rank // tp_size, pp_size)
        with torch.device("meta"):
            yield LlamaForCausalLM(cfg, layout, dtype, quant)
