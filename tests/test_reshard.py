"""The `peer` weights strategy's plan (`distributed/reshard.py`): the slices every rank of a new
layout needs, covered by slices the old layout's ranks hold. Executed here in one process
(every rank's model side by side, the moves as copies), the result must equal each new rank
loading its shard from the checkpoint, bit for bit; over real ranks in tests/test_flip.py."""

from __future__ import annotations

import pytest
import torch

from phaseflip.distributed.reshard import checkpoint_names, layout_pieces, plan_moves
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import checkpoint_tensor_specs, iter_checkpoint_tensors
from phaseflip.model.quant import resolve_quantization


def _loaded(model_dir, m: ModelConfig, tp: int, pp: int, quant=None) -> list[LlamaForCausalLM]:
    out = []
    for rank in range(tp * pp):
        model = LlamaForCausalLM(m, Layout(rank % tp, tp, rank // tp, pp), torch.float32,
                                 quant)
        model.load_weights(iter_checkpoint_tensors(model_dir))
        out.append(model)
    return out


@pytest.mark.parametrize("arch", ["llama", "llama-tied-mqa", "qwen2", "llama-fp8"])
@pytest.mark.parametrize("old, new", [((2, 1), (1, 2)), ((1, 2), (2, 1)),
                                      ((4, 1), (2, 2)), ((2, 2), (4, 1))])
def test_the_moves_rebuild_every_new_shard_exactly(model_dirs, arch, old, new):
    """FP8 (quantized at load): the FP8 slices and their row scales move as they are."""
    quant = resolve_quantization("fp8", "", "dummy") if arch == "llama-fp8" else None
    model_dir = model_dirs[arch.removesuffix("-fp8")]
    m = ModelConfig.from_dir(str(model_dir))
    names = checkpoint_names(m, torch.float32, quant)
    if quant is None:  # the names read off the model are the checkpoint's
        assert sorted(names) == sorted(spec[0] for spec in checkpoint_tensor_specs(model_dir))
    moves = plan_moves(layout_pieces(m, *old, torch.float32, names, quant),
                       layout_pieces(m, *new, torch.float32, names, quant))
    sources, want = _loaded(model_dir, m, *old, quant), _loaded(model_dir, m, *new, quant)
    got = [LlamaForCausalLM(m, Layout(r % new[0], new[0], r // new[0], new[1]), torch.float32,
                            quant) for r in range(len(want))]
    for model in got:
        for p in model.parameters():
            p.data.view(torch.uint8).fill_(255)  # a slice no move wrote stays NaN (any dtype)
    for mv in moves:
        src = dict(sources[mv.src].named_parameters(remove_duplicate=False))[mv.src_param]
        dst = dict(got[mv.dst].named_parameters(remove_duplicate=False))[mv.dst_param]
        dst.data.narrow(mv.dim, mv.dst_offset, mv.size).copy_(
            src.data.narrow(mv.dim, mv.src_offset, mv.size))
    for rank, (g, w) in enumerate(zip(got, want, strict=True)):
        wp = dict(w.named_parameters())
        for name, p in g.named_parameters():
            rows = p.data
            if "embed_tokens" in name or "lm_head" in name:  # padding rows: zero on load
                rows = rows[: max(0, m.vocab_size - _start(g, name))]
                wp_rows = wp[name].data[: rows.shape[0]]
            else:
                wp_rows = wp[name].data
            assert torch.equal(rows.view(torch.uint8), wp_rows.view(torch.uint8)), (rank, name)
    # each rank keeps what it holds: only the rest crosses, less than its whole shard
    for rank, model in enumerate(got):
        params = dict(model.named_parameters(remove_duplicate=False))
        crossed = sum(_bytes(params[mv.dst_param], mv) for mv in moves
                      if mv.dst == rank and mv.src != rank)
        kept = sum(_bytes(params[mv.dst_param], mv) for mv in moves
                   if mv.dst == rank and mv.src == rank)
        assert 0 < crossed and 0 < kept, (rank, crossed, kept)


def _bytes(p: torch.Tensor, mv) -> int:
    return p.numel() // p.shape[mv.dim] * mv.size * p.element_size()


def _start(model: LlamaForCausalLM, name: str) -> int:
    module = model.get_submodule(name.rpartition(".")[0])
    return module.start
