"""The `peer` weights strategy of a phase flip: every rank keeps the slices of the checkpoint
it already holds and receives only the missing ones from the ranks that hold them.

Every parameter of a layout is made of slices of checkpoint tensors along one dimension (a
column-parallel weight: rows; a row-parallel one: columns; fused q/k/v and gate/up: several
tensors stacked; norms: whole). `pieces` reads that map off a model's layers — the same
attributes their weight loaders slice with — for the model of every rank of both layouts,
built on the meta device (nothing allocated). `plan_moves` covers each piece of the new layout
with pieces of the old one, the rank's own first; what is left crosses between ranks. Every
rank computes the same plan, so no plan is exchanged.

`PeerWeights.load_into` runs at the seam on every rank at once, after the old KV pool was
released: local slices are copied on the device; each ordered pair of ranks exchanges its
slices as one packed buffer per chunk of at most `CHUNK_BYTES`, pairs in one global order (the
blocking sends and receives of gloo cannot cross). NCCL moves device tensors; gloo moves host
tensors (a CPU run, or ranks sharing one GPU, whose slices are staged through the host). The
old model is freed right after, before the new pool is sized. FP8 weights move as they are:
every tensor is quantized before it is sliced, so a rank's FP8 slices and row scales are the
new layout's too (a row-parallel scale covers the whole row and is kept whole).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from phaseflip.model.config import ModelConfig
from phaseflip.model.layers import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from phaseflip.model.llama import _FUSED, LlamaForCausalLM, meta_shards
from phaseflip.model.quant import Fp8Config
from phaseflip.model.runner import free_model
from phaseflip.model.weight_image import WeightsLoad

CHUNK_BYTES = 256 * 2**20  # one message's payload: bounds the packing buffers at the seam


@dataclass(frozen=True)
class Piece:
    """`param.narrow(dim, offset, size)` holds `checkpoint[name].narrow(dim, start, size)`."""

    param: str
    dim: int
    start: int
    size: int
    offset: int


@dataclass(frozen=True)
class Move:
    """A slice of a checkpoint tensor from rank `src`'s old model into rank `dst`'s new one."""

    src: int
    dst: int
    src_param: str
    dst_param: str
    dim: int
    src_offset: int
    dst_offset: int
    size: int


def _piece(module: nn.Module, attr: str, shard: object, param: torch.Tensor
           ) -> tuple[int, int, int, int]:
    """(dim, start in the checkpoint tensor, size, offset in the parameter) of one loader call."""
    if isinstance(module, MergedColumnParallelLinear):
        i = int(shard)  # type: ignore[arg-type]
        return 0, module.shards[i][0], module.local_sizes[i], sum(module.local_sizes[:i])
    if isinstance(module, QKVParallelLinear):
        offset = {"q": 0, "k": module.q_size, "v": module.q_size + module.kv_size}[shard]
        start, size = module.rows[shard]  # type: ignore[index]
        return 0, start, size, offset
    if isinstance(module, RowParallelLinear) and attr == "weight":
        return 1, module.in_start, module.in_local, 0
    if isinstance(module, VocabParallelEmbedding) and attr == "weight":
        valid = max(0, min(module.end, module.vocab_size) - module.start)
        return 0, module.start, valid, 0
    return 0, 0, param.shape[0], 0  # whole (norms, biases of row-parallel layers)


def pieces(model: LlamaForCausalLM, names: Iterable[str]) -> dict[str, list[Piece]]:
    """Checkpoint tensor name → where its slices live in `model` (works on the meta device)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, list[Piece]] = {}
    for name in names:
        target = model._param_name(name)
        if target is None or target[0] not in params:
            continue
        pname, shard = target
        owner, _, attr = pname.rpartition(".")
        dim, start, size, offset = _piece(model.get_submodule(owner), attr, shard,
                                          params[pname])
        out.setdefault(name, []).append(Piece(pname, dim, start, size, offset))
    return out


def checkpoint_names(model_cfg: ModelConfig, dtype: torch.dtype,
                     quant: Fp8Config | None = None) -> list[str]:
    """The checkpoint tensor names of the model, as the loader maps them (read off the whole
    model on the meta device: the same list for a real checkpoint and for dummy weights; FP8
    weights' row scales included, which shard along the rows as their weights do)."""
    (model,) = meta_shards(model_cfg, 1, 1, dtype, quant)
    names = []
    for pname, _ in model.named_parameters():
        fused = next(((src, dst) for src, dst, _ in _FUSED if f".{dst}." in pname), None)
        parts = [pname] if fused is None else [
            pname.replace(fused[1], src) for src, dst, _ in _FUSED if dst == fused[1]]
        names += [n if n.startswith("lm_head.") else f"model.{n}" for n in parts]
    return names


def layout_pieces(model_cfg: ModelConfig, tp: int, pp: int, dtype: torch.dtype,
                  names: list[str], quant: Fp8Config | None = None
                  ) -> list[dict[str, list[Piece]]]:
    """`pieces` of every rank of a tp × pp layout (rank = pp_rank * tp + tp_rank)."""
    return [pieces(model, names) for model in meta_shards(model_cfg, tp, pp, dtype, quant)]


def plan_moves(old: list[dict[str, list[Piece]]], new: list[dict[str, list[Piece]]]
               ) -> list[Move]:
    """Covers every piece of the new layout with slices of the old one: the rank's own
    first, then the lowest rank holding the rest. Raises if the old layout lacks a slice."""
    moves = []
    for dst, wanted in enumerate(new):
        for name, targets in wanted.items():
            holders = [(dst, q) for q in old[dst].get(name, [])] + [
                (r, q) for r in range(len(old)) if r != dst for q in old[r].get(name, [])]
            for p in targets:
                a, end = p.start, p.start + p.size
                while a < end:
                    src, q = next(((r, q) for r, q in holders if q.dim == p.dim
                                   and q.start <= a < q.start + q.size), (None, None))
                    if q is None:
                        raise ValueError(f"no rank of the old layout holds {name}[{a}] "
                                         f"along dim {p.dim}")
                    b = min(end, q.start + q.size)
                    moves.append(Move(src, dst, q.param, p.param, p.dim,
                                      q.offset + a - q.start, p.offset + a - p.start, b - a))
                    a = b
    return moves


def plan_between(model_cfg: ModelConfig, old: tuple[int, int], new: tuple[int, int],
                 dtype: torch.dtype, quant: Fp8Config | None = None) -> list[Move]:
    """The moves from layout `old` (tp, pp) to `new`, planned alike on every rank (~40 ms
    for an 8B model on the CPU box: worth caching per pair of layouts)."""
    names = checkpoint_names(model_cfg, dtype, quant)
    return plan_moves(layout_pieces(model_cfg, *old, dtype, names, quant),
                      layout_pieces(model_cfg, *new, dtype, names, quant))


class PeerWeights:
    """This rank's part of a seam's weight exchange (see the module docstring): called with
    the new layout's (empty) model, it fills it and frees the old one."""

    def __init__(self, rank: int, old_model: LlamaForCausalLM, moves: list[Move],
                 staged: bool) -> None:
        self.rank, self.old, self.moves, self.staged = rank, old_model, moves, staged


    def __call__(self, model: LlamaForCausalLM) -> WeightsLoad:
        try:
            return self.load_into(model)
        finally:
            free_model(self.old)  # before the new pool is sized from what is free

    def load_into(self, model: LlamaForCausalLM) -> WeightsLoad:
        """Fills `model` (every rank calls it at once); returns the load, bytes received."""
        t0 = time.perf_counter()
        old = dict(self.old.named_parameters(remove_duplicate=False))
        new = dict(model.named_parameters(remove_duplicate=False))
        for p in new.values():  # the vocabulary's padding rows stay zero, as a load leaves them
            p.data.zero_()
        received = 0
        pairs = sorted({(m.src, m.dst) for m in self.moves})
        for src, dst in pairs:
            if self.rank not in (src, dst):
                continue
            mine = [m for m in self.moves if (m.src, m.dst) == (src, dst)]
            if src == dst:
                for m in mine:
                    _dst(new, m).copy_(_src(old, m))
            elif src == self.rank:
                for chunk in _chunks(mine, old, sender=True):
                    self._send(chunk, old, dst)
            else:
                for chunk in _chunks(mine, new, sender=False):
                    received += self._recv(chunk, new, src)
        if next(model.parameters()).device.type == "cuda":
            torch.cuda.synchronize()
        return WeightsLoad("peer", time.perf_counter() - t0, bytes_moved=received)

    def _send(self, chunk: list[Move], old: dict, dst: int) -> None:
        flat = torch.cat([_src(old, m).reshape(-1).view(torch.uint8) for m in chunk])
        dist.send(flat.cpu() if self.staged else flat, dst)

    def _recv(self, chunk: list[Move], new: dict, src: int) -> int:
        views = [_dst(new, m) for m in chunk]
        device = torch.device("cpu") if self.staged else views[0].device
        flat = torch.empty(sum(v.numel() * v.element_size() for v in views),
                           dtype=torch.uint8, device=device)
        dist.recv(flat, src)
        at = 0
        for v in views:
            n = v.numel() * v.element_size()
            v.copy_(flat[at:at + n].view(v.dtype).view(v.shape))
            at += n
        return at


def _src(params: dict, m: Move) -> torch.Tensor:
    return params[m.src_param].data.narrow(m.dim, m.src_offset, m.size).contiguous()


def _dst(params: dict, m: Move) -> torch.Tensor:
    return params[m.dst_param].data.narrow(m.dim, m.dst_offset, m.size)


def _chunks(moves: list[Move], params: dict, sender: bool) -> list[list[Move]]:
    """Moves grouped into messages of at most CHUNK_BYTES (a larger slice goes alone). Both
    sides cut the same way: a slice's bytes are the same read off the sender's parameter and
    the receiver's (every dimension but `dim` is the checkpoint tensor's, whole)."""
    out: list[list[Move]] = [[]]
    size = 0
    for m in moves:
        p = params[m.src_param if sender else m.dst_param]
        n = p.numel() // p.shape[m.dim] * m.size * p.element_size()
        if out[-1] and size + n > CHUNK_BYTES:
            out.append([])
            size = 0
        out[-1].append(m)
        size += n
    return [c for c in out if c]
