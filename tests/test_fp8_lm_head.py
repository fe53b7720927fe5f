"""The FP8 LM head (`--fp8-lm-head`, `model/lm_head.py`): a per-row FP8 copy of the head's
weight made after every load path, read by the logits GEMM; refused without FP8 weights; the
same numbers in every TP shard and after phase flips (which move only the 16-bit weight)."""

from __future__ import annotations

import os

import pytest
import torch

from phaseflip.cli import build_parser
from phaseflip.config import EMBEDDED_MODEL, EngineConfig
from phaseflip.errors import ModelLoadError
from phaseflip.flip.weights import shard_bytes
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import iter_checkpoint_tensors
from phaseflip.model.quant import FP8_DTYPE, Fp8Config, resolve_quantization
from phaseflip.model.quant.fp8 import quantize_rows
from tests.test_fp8_weights import _logprobs

pytestmark = pytest.mark.timeout(300, method="thread")  # tp2 and flips spawn gloo ranks

HEAD = Fp8Config("float", lm_head=True)


def _model(layout: Layout | None = None, quant: Fp8Config | None = HEAD,
           derive: bool = True) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    model = LlamaForCausalLM(cfg, layout or Layout(), torch.float32, quant)
    model.load_weights(iter_checkpoint_tensors(EMBEDDED_MODEL))
    if derive:
        model.lm_head.quantize_()
    return model


def test_needs_fp8_weights_and_parses():
    with pytest.raises(ModelLoadError, match="--fp8-lm-head"):
        resolve_quantization(None, EMBEDDED_MODEL, lm_head=True)
    assert resolve_quantization("fp8", EMBEDDED_MODEL, lm_head=True) == HEAD
    assert resolve_quantization("fp8", EMBEDDED_MODEL) == Fp8Config("float")
    args = build_parser().parse_args(["serve", "--quantization", "fp8", "--fp8-lm-head"])
    assert args.fp8_lm_head and not EngineConfig().fp8_lm_head


def test_the_copy_is_per_row_fp8_of_the_weight_in_every_tp_shard():
    """The embedded model ties its head to the embedding: the copy is of that weight, per
    vocabulary row, and tp2's shards, stacked, are the one process's copy."""
    full = _model()
    head = full.lm_head
    q, s = quantize_rows(full.embed_tokens.weight)
    assert head.fp8_weight.dtype == FP8_DTYPE and torch.equal(head.fp8_scale, s)
    assert torch.equal(head.fp8_weight.float(), q.float())
    assert head.weight is full.embed_tokens.weight  # the 16-bit weight stays (embedding, flips)
    ranks = [_model(Layout(r, 2)).lm_head for r in range(2)]
    assert torch.equal(torch.cat([r.fp8_scale for r in ranks])[: s.shape[0]], s)
    assert torch.equal(torch.cat([r.fp8_weight.float() for r in ranks])[: s.shape[0]],
                       q.float())


def test_logits_read_the_copy_and_an_underived_head_refuses():
    """FP8 logits: close to the float head's, not equal to them (the FP8 GEMM ran), and the
    head refuses to run on a copy never made (rather than on an empty buffer's values)."""
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    ref = _model(quant=Fp8Config("float")).lm_head.logits(hidden)
    got = _model().lm_head.logits(hidden)
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.05, rel
    with pytest.raises(RuntimeError, match="not quantized"):
        _model(derive=False).lm_head.logits(hidden)


def test_shard_bytes_count_the_copy():
    cfg = ModelConfig.from_dir(EMBEDDED_MODEL)
    plain = shard_bytes(cfg, 1, 2, torch.float32, Fp8Config("float"))
    fp8 = shard_bytes(cfg, 1, 2, torch.float32, HEAD)
    rows, hidden = cfg.vocab_size, cfg.hidden_size
    assert fp8[0] == plain[0] and fp8[1] == plain[1] + rows * hidden + 4 * rows


def test_engine_on_the_test_device(make_engine):
    """On the test device (PHASEFLIP_TEST_DEVICE=cuda: bf16, the decode graphs, the skinny,
    tile or cuBLAS FP8 GEMM for the head's rows): the same tokens' logprobs within FP8's
    error of the FP8 engine without the head in FP8, and not equal to them."""
    cuda = os.environ.get("PHASEFLIP_TEST_DEVICE") == "cuda"
    opts = {"quantization": "fp8", "dtype": "bfloat16" if cuda else "float32"}
    lp0, _ = _logprobs(make_engine(EMBEDDED_MODEL, **opts))
    lp1, _ = _logprobs(make_engine(EMBEDDED_MODEL, fp8_lm_head=True, **opts))
    head = [abs(a - b) for r0, r1 in zip(lp0, lp1) for a, b in zip(r0, r1)]
    assert 0 < sum(head) / len(head) < 0.1, sum(head) / len(head)


def test_engine_tp2_matches_one_process(make_engine):
    """End to end on the CPU: the FP8 head changes logprobs against the FP8 engine without it
    (by FP8's error, docs/quantization.md), and tp2's vocabulary shards give one process's
    tokens and logprobs up to the float32 reduction order."""
    lp0, _ = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8", device="cpu"))
    lp1, tok1 = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8", fp8_lm_head=True,
                                      device="cpu"))
    head = [abs(a - b) for r0, r1 in zip(lp0, lp1) for a, b in zip(r0, r1)]
    assert 0 < sum(head) / len(head) < 0.06
    lp2, tok2 = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8", fp8_lm_head=True,
                                      tp_size=2, dist_timeout_s=60, device="cpu"))
    diffs = [abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)]
    assert tok1 == tok2
    assert sum(diffs) / len(diffs) < 1e-3, sum(diffs) / len(diffs)


def test_peer_flips_remake_the_copy(model_dirs):
    """Three flips with the peer strategy (the new layout's weights filled from slices, not
    loaded): the copy is remade on every new layout, so the outputs equal a reload's."""
    from phaseflip import Engine
    from tests.conftest import prompts_for
    from tests.test_flip import CFG, FLIP, _drive

    runs = {}
    for strategy in ("reload", "peer"):
        with Engine(str(model_dirs["llama"]), tp_size=2, flip_weights=strategy,
                    quantization="fp8", fp8_lm_head=True, **FLIP, **CFG) as e:
            runs[strategy], censuses = _drive(e, prompts_for(300), {1: (1, 2), 4: (2, 1),
                                                                    8: (1, 2)})
        assert [c.weights for c in censuses] == [strategy] * 3
    assert runs["peer"] == runs["reload"]


@pytest.mark.parametrize("fmt", ["compressed-tensors-channel", "block"])
def test_a_checkpoint_storing_its_head_in_fp8_is_dequantized(fmt, model_dirs, make_engine,
                                                             tmp_path):
    """A checkpoint whose LM head is FP8 too (one that did not `ignore` it): the head is
    dequantized with its scale (per row, or per block), not cast bare — which scaled each
    row's logits by 1 / its scale. Against the same checkpoint with a float head: within
    FP8's error."""
    from safetensors.torch import load_file, save_file

    from phaseflip.model.quant.export import write_fp8_checkpoint
    from phaseflip.model.quant.fp8 import quantize_blocks

    plain = write_fp8_checkpoint(model_dirs["llama"], tmp_path / "plain", fmt)
    headed = write_fp8_checkpoint(model_dirs["llama"], tmp_path / "head", fmt)
    path = headed / "model.safetensors"
    tensors = load_file(str(path))
    w = tensors["lm_head.weight"].float()
    if fmt == "block":
        q, s = quantize_blocks(w, (128, 128))
        tensors.update({"lm_head.weight": q, "lm_head.weight_scale_inv": s})
    else:
        q, s = quantize_rows(w)
        tensors.update({"lm_head.weight": q,
                        "lm_head.weight_scale": s.reshape(-1, 1).to(torch.bfloat16)})
    save_file(tensors, str(path), metadata={"format": "pt"})
    lp0, _ = _logprobs(make_engine(plain, device="cpu"))
    lp1, _ = _logprobs(make_engine(headed, device="cpu"))
    diffs = [abs(a - b) for r0, r1 in zip(lp0, lp1) for a, b in zip(r0, r1)]
    assert 0 < sum(diffs) / len(diffs) < 0.06, sum(diffs) / len(diffs)
