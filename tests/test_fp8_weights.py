"""FP8 weights (`--quantization fp8`, and FP8 checkpoints): numerics, the checkpoint formats
people download (built here from the embedded model's float weights: no download), tensor-
parallel sharding of FP8 weights and their scales, and the engine end to end on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from phaseflip.config import EMBEDDED_MODEL, EngineConfig
from phaseflip.errors import InvalidRequestError, ModelLoadError
from phaseflip.layout import Layout
from phaseflip.model.config import ModelConfig
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import iter_checkpoint_tensors
from phaseflip.model.quant import FP8_DTYPE, Fp8Config, convert_checkpoint, resolve_quantization
from phaseflip.model.quant.export import write_fp8_checkpoint
from phaseflip.model.quant.fp8 import (
    dequantize_blocks,
    quantize_blocks,
    quantize_per_tensor,
    quantize_rows,
    scaled_linear,
    scaled_linear_ref,
)

pytestmark = pytest.mark.timeout(300, method="thread")  # the tp2 test spawns gloo ranks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------- numerics


def test_row_quantization_is_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 1, 48)[:, None]
    q, s = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and s.shape == (48,)
    assert torch.allclose(q.float().abs().amax(1), torch.full((48,), 448.0))  # full range
    # relative error per row ~ e4m3's 2^-4 half-ulp, whatever the row's magnitude
    err = ((q.float() * s[:, None] - w).norm(dim=1) / w.norm(dim=1))
    assert err.max() < 0.04


def test_block_quantization_round_trip_with_partial_edge_tiles():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen)  # 128-blocks: edge tiles 72 x 44
    q, s_inv = quantize_blocks(w, (128, 128))
    assert q.shape == w.shape and s_inv.shape == (2, 3)
    assert _rel(dequantize_blocks(q, s_inv, (128, 128)), w) < 0.04
    q1, s1 = quantize_per_tensor(w)
    assert s1.dim() == 0 and _rel(q1.float() * s1, w) < 0.04


def test_scaled_linear_reference_matches_the_float_linear():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 64, generator=gen)
    w = torch.randn(32, 64, generator=gen) * 0.02
    b = torch.randn(32, generator=gen)
    q, s = quantize_rows(w)
    y = scaled_linear_ref(x, q, s, b)
    assert y.shape == (5, 3, 32) and y.dtype == x.dtype
    assert _rel(y, torch.nn.functional.linear(x, w, b)) < 0.06
    assert torch.equal(scaled_linear(x, q, s, b), y)  # CPU: the reference path


# ---------------------------------------------------------------- scheme resolution


def test_config_validates_the_flags():
    assert EngineConfig(quantization="fp8", kv_cache_dtype="fp8_e4m3").quantization == "fp8"
    with pytest.raises(InvalidRequestError, match="quantization"):
        EngineConfig(quantization="int4")
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")


def test_cli_flags():
    from phaseflip.cli import build_parser

    args = build_parser().parse_args(["serve", "--quantization", "fp8",
                                      "--kv-cache-dtype", "fp8_e4m3"])
    assert args.quantization == "fp8" and args.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "awq"])


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {fmt: write_fp8_checkpoint(EMBEDDED_MODEL, root / fmt, fmt)
            for fmt in ("compressed-tensors-channel", "compressed-tensors-tensor", "block")}


def test_scheme_follows_flag_and_checkpoint(fp8_dirs, tmp_path):
    assert resolve_quantization(None, EMBEDDED_MODEL) is None
    assert resolve_quantization("fp8", EMBEDDED_MODEL) == Fp8Config("float")
    # an FP8 checkpoint runs FP8 with or without the flag
    assert resolve_quantization(None, fp8_dirs["block"]) == Fp8Config("fp8-block", (128, 128))
    assert resolve_quantization("fp8", fp8_dirs["compressed-tensors-tensor"]).source == \
        "compressed-tensors"
    raw = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="'awq'"):
        resolve_quantization(None, tmp_path)


# ---------------------------------------------------------------- checkpoint formats


def _model(model_dir, quant: Fp8Config | None, layout: Layout | None = None
           ) -> LlamaForCausalLM:
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, layout or Layout(), torch.float32, quant)
    model.load_weights(iter_checkpoint_tensors(model_dir, progress=False))
    return model


def _dequantized(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    out = {}
    for name, mod in model.named_modules():
        if getattr(mod, "weight_scale", None) is not None:
            out[name] = mod.weight.float() * mod.weight_scale[:, None]
    return out


@pytest.fixture(scope="module")
def at_load():
    """The embedded float checkpoint quantized at load (--quantization fp8)."""
    return _model(EMBEDDED_MODEL, Fp8Config("float"))


def test_quantized_at_load_holds_fp8_projections_and_float_rest(at_load):
    layer = at_load.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                layer.mlp.down_proj):
        assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale.dtype == torch.float32
        assert lin.weight_scale.shape == lin.weight.shape[:1]
    assert at_load.embed_tokens.weight.dtype == torch.float32
    ref = _model(EMBEDDED_MODEL, None)
    deq = _dequantized(at_load)
    for name, w in deq.items():
        assert _rel(w, ref.get_submodule(name).weight) < 0.04, name


def test_compressed_tensors_per_channel_loads_the_same_numbers(at_load, fp8_dirs):
    """Per-channel compressed-tensors = quantize-at-load: the same FP8 rows, and the same
    scales up to their storage dtype (llm-compressor writes them in bf16, as export does)."""
    model = _model(fp8_dirs["compressed-tensors-channel"],
                   resolve_quantization(None, fp8_dirs["compressed-tensors-channel"]))
    for (n, a), (_, b) in zip(at_load.named_parameters(), model.named_parameters()):
        if n.endswith("weight_scale"):
            a = a.to(torch.bfloat16)
        assert torch.equal(a.float(), b.float()), n


@pytest.mark.parametrize("fmt,bound", [("compressed-tensors-tensor", 0.04), ("block", 0.05)])
def test_per_tensor_and_block_checkpoints_load_close_to_float(fmt, bound, fp8_dirs):
    """Per-tensor scales become exact per-row scales; block-wise weights are re-quantized per
    row (one more rounding: hence the looser bound)."""
    ref = _model(EMBEDDED_MODEL, None)
    model = _model(fp8_dirs[fmt], resolve_quantization(None, fp8_dirs[fmt]))
    for name, w in _dequantized(model).items():
        assert _rel(w, ref.get_submodule(name).weight) < bound, name
    if fmt == "compressed-tensors-tensor":  # the fused qkv keeps q, k, v's own scales
        s = model.layers[0].self_attn.qkv_proj.weight_scale
        q_size = model.layers[0].self_attn.qkv_proj.q_size
        assert torch.all(s[:q_size] == s[0]) and not torch.all(s == s[0])


def test_block_checkpoint_without_its_scale_is_refused():
    w = torch.randn(64, 32).to(FP8_DTYPE)
    with pytest.raises(ModelLoadError, match="lack a weight or its scale"):
        list(convert_checkpoint([("model.layers.0.mlp.down_proj.weight", w)],
                                Fp8Config("fp8-block", (128, 128)), torch.device("cpu")))


def test_scale_before_weight_and_input_scales_dropped():
    q, s = quantize_rows(torch.randn(16, 8))
    stream = [("model.layers.0.self_attn.o_proj.weight_scale", s.reshape(-1, 1)),
              ("model.layers.0.self_attn.o_proj.input_scale", torch.tensor(0.1)),
              ("model.layers.0.self_attn.o_proj.weight", q),
              ("model.norm.weight", torch.ones(8))]
    out = dict(convert_checkpoint(stream, Fp8Config("compressed-tensors"), torch.device("cpu")))
    assert set(out) == {"model.layers.0.self_attn.o_proj.weight",
                        "model.layers.0.self_attn.o_proj.weight_scale", "model.norm.weight"}
    assert torch.equal(out["model.layers.0.self_attn.o_proj.weight_scale"], s)


# ---------------------------------------------------------------- tensor parallel


def test_tp2_shards_of_fp8_weights_and_scales_are_the_one_process_numbers(at_load):
    """Each TP rank's FP8 rows/columns and scales, reassembled, equal one process's: the
    column-parallel scales follow their rows (fused qkv and gate_up shard by shard), the row-
    parallel scale covers the whole row on every rank (quantized before slicing)."""
    ranks = [_model(EMBEDDED_MODEL, Fp8Config("float"), Layout(r, 2)) for r in range(2)]
    for i, full in enumerate(at_load.layers):
        parts = [m.layers[i] for m in ranks]
        qkv = full.self_attn.qkv_proj
        sizes = [qkv.q_size // 2, qkv.kv_size // 2, qkv.kv_size // 2]
        for attr in ("weight", "weight_scale"):
            pieces = [getattr(p.self_attn.qkv_proj, attr).float().split(sizes) for p in parts]
            want = torch.cat([pieces[r][j] for j in range(3) for r in range(2)])
            assert torch.equal(want, getattr(qkv, attr).float()), attr
            half = full.mlp.gate_up_proj.weight.shape[0] // 4
            pieces = [getattr(p.mlp.gate_up_proj, attr).float().split(half) for p in parts]
            want = torch.cat([pieces[r][j] for j in range(2) for r in range(2)])
            assert torch.equal(want, getattr(full.mlp.gate_up_proj, attr).float()), attr
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            lin = full.get_submodule(name)
            shards = [p.get_submodule(name) for p in parts]
            assert torch.equal(torch.cat([s.weight.float() for s in shards], 1),
                               lin.weight.float())
            for s in shards:
                assert torch.equal(s.weight_scale, lin.weight_scale)


PROMPTS = [[(11 * i + 7 * j) % 4000 + 5 for j in range(24)] for i in range(3)]


def _logprobs(engine, prompts=PROMPTS):
    from phaseflip import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True,
                            prompt_logprobs=0)
    outs = engine.generate(prompts, params, use_tqdm=False)
    return [o.prompt_logprobs[1:] for o in outs], [o.token_ids for o in outs]


def test_tp2_on_gloo_matches_one_process(make_engine):
    """tp2 (two gloo ranks) FP8 = one FP8 process up to the float32 reduction order: the same
    weights (above), and a row-parallel layer's per-token activation scale is the whole row's
    (a max-reduce over the group), not each rank's slice's. Without that reduce the ranks
    round activations differently: 0.018-0.028 mean |dlogprob| from one process, the order of
    FP8's own error, and a phase flip between TP and PP changed greedy tokens.

    On the CPU (the float32 reference GEMM) on purpose: on CUDA `_scaled_mm` rounds each rank's
    partial product to bf16 before the all-reduce, a difference of the same size (0.022 on the
    H200) as the defect this test catches."""
    lp1, tok1 = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8", device="cpu"))
    two = make_engine(EMBEDDED_MODEL, quantization="fp8", tp_size=2, dist_timeout_s=60,
                      device="cpu")
    lp2, tok2 = _logprobs(two)
    diffs = [abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)]
    assert tok1 == tok2
    assert sum(diffs) / len(diffs) < 1e-3, sum(diffs) / len(diffs)


def test_engine_runs_fp8_checkpoints_close_to_float(make_engine, fp8_dirs):
    """The engine end to end on each FP8 format (the scheme comes from the checkpoint)."""
    lp_ref, _ = _logprobs(make_engine(EMBEDDED_MODEL))
    for fmt, path in fp8_dirs.items():
        lp, _ = _logprobs(make_engine(path))
        diffs = [abs(a - b) for r1, r2 in zip(lp_ref, lp) for a, b in zip(r1, r2)]
        assert 0 < sum(diffs) / len(diffs) < 0.06, fmt


def test_pp2_matches_one_process_exactly(make_engine):
    """Pipeline stages hold whole rows, so FP8 under pp2 computes one process's numbers: each
    stage converts only its own layers' tensors (the loader's stage filter) and finds them
    all (the completeness check)."""
    lp1, tok1 = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8"))
    lp2, tok2 = _logprobs(make_engine(EMBEDDED_MODEL, quantization="fp8", pp_size=2,
                                      dist_timeout_s=60))
    assert tok1 == tok2
    assert max(abs(a - b) for r1, r2 in zip(lp1, lp2) for a, b in zip(r1, r2)) < 1e-5


@pytest.mark.parametrize("fmt", ["block", "compressed-tensors-tensor"])
def test_host_weight_image_of_an_fp8_checkpoint(fmt, fp8_dirs, tmp_path):
    """A flip's ranks load from the host image of the checkpoint as stored (FP8 tensors and
    their scales, weight_scale_inv included): the same parameters as from disk, for each TP
    rank's shard."""
    from phaseflip.model.weight_image import WeightImage, load_model_weights

    path = fp8_dirs[fmt]
    quant = resolve_quantization(None, path)
    image = WeightImage.build(path, tmp_path / "image", register=False)
    try:
        for rank in range(2):
            disk = _model(path, quant, Layout(rank, 2))
            cfg = ModelConfig.from_dir(path)
            model = LlamaForCausalLM(cfg, Layout(rank, 2), torch.float32, quant)
            load_model_weights(model, EngineConfig(model=str(path), device="cpu"), str(path),
                               torch.device("cpu"), image)
            for (n, a), (_, b) in zip(disk.named_parameters(), model.named_parameters()):
                assert torch.equal(a.float(), b.float()), n
    finally:
        image.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama-tied-mqa"])
def test_every_architecture_runs_fp8(arch, model_dirs, make_engine):
    """FP8 weights and KV on each supported family (Qwen2's qkv bias, Qwen3's q/k norms,
    Mistral's sliding window, tied embeddings with MQA). These test models have random
    weights, where FP8 is far from float (docs/quantization.md): measured FP8 weights
    0.12-0.21 and FP8 KV 0.06-0.08 mean |dlogprob| (bf16 itself 0.013-0.021), alike for every
    family, so the bound catches a family-specific break (a bias or norm lost), not noise."""
    from tests.conftest import prompts_for

    prompts = prompts_for(make_engine(model_dirs[arch]).model_config.vocab_size)[:3]
    ref, _ = _logprobs(make_engine(model_dirs[arch]), prompts)
    got, _ = _logprobs(make_engine(model_dirs[arch], quantization="fp8",
                                   kv_cache_dtype="fp8_e4m3"), prompts)
    diffs = [abs(a - b) for r1, r2 in zip(ref, got) for a, b in zip(r1, r2)]
    assert 0 < sum(diffs) / len(diffs) < 0.4, sum(diffs) / len(diffs)


def test_the_runner_says_what_it_runs_in():
    """/server_info's `numerics`: the resolved dtypes and scheme, not only the flags."""
    from phaseflip import Engine
    from phaseflip.config import EMBEDDED_MODEL

    with Engine(str(EMBEDDED_MODEL), device="cpu", quantization="fp8",
                kv_cache_dtype="fp8_e4m3", max_total_tokens=1024) as e:
        assert e.core.runner.numerics == {"dtype": "float32",
                                          "kv_cache_dtype": "float8_e4m3fn",
                                          "quantization": "fp8 (float)"}
