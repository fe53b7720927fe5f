"""Dummy weights, bundled configs, random checkpoints and the benchmark scripts, on CPU.

The benchmark scripts are run in-process through their `main(argv)` (a subprocess per script
would spend most of the test budget importing torch); the serving benchmark talks to a real
`phaseflip serve` subprocess.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from phaseflip.attention.torch_ref import TorchRefAttention
from phaseflip.cache.kv_pool import KVPool
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.forward_batch import ForwardBatch
from phaseflip.layout import Layout
from phaseflip.model.bundled import CONFIGS_DIR, bundled_models, resolve_model_dir
from phaseflip.model.config import ModelConfig
from phaseflip.model.dummy import (
    checkpoint_shapes,
    init_dummy_weights,
    num_parameters,
    write_random_checkpoint,
)
from phaseflip.model.llama import LlamaForCausalLM
from phaseflip.model.loader import iter_checkpoint_tensors

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "num_hidden_layers": 2,
          "bos_token_id": 0, "eos_token_id": 0}


def shrunk_dir(name: str, out: Path, **over) -> Path:
    """A bundled config with small dimensions (same architecture, rope and flags)."""
    raw = json.loads((CONFIGS_DIR / f"{name}.json").read_text())
    raw.update(SHRINK, **over)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def prefill_logits(model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype,
                   n: int = 12) -> torch.Tensor:
    """Logits of every position of one random prompt (one prefill forward, no engine)."""
    pool = KVPool(n + 1, (0, cfg.num_layers), cfg.num_kv_heads, cfg.head_dim, dtype,
                  torch.device("cpu"))
    pos = torch.arange(n)
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    batch = ForwardBatch(input_ids=ids, positions=pos, out_cache_loc=pos + 1, extend_lens=[n],
                         prefix_lens=[0], kv_indptr=torch.tensor([0, n]), kv_indices=pos + 1,
                         logits_indices=pos, max_position=n - 1)
    with torch.inference_mode():
        hidden, _ = model(batch, pool, TorchRefAttention())
        return model.compute_logits(hidden)


def dummy_model(d: Path, dtype: torch.dtype, seed: int) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_dir(d), Layout(), dtype)
    init_dummy_weights(model, seed)
    return model


# ---------------------------------------------------------------------------------------------
# Bundled configs


EXPECTED_PARAMS = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.55e9, "qwen3-8b": 8.19e9,
                   "llama-3.2-1b": 1.24e9, "qwen3-0.6b": 0.596e9}


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_bundled_config_parses_with_expected_size(name, tmp_path):
    d = resolve_model_dir(name, cache_dir=tmp_path)
    assert d == tmp_path / "dummy" / name
    cfg = ModelConfig.from_dir(d)
    assert num_parameters(cfg) == pytest.approx(EXPECTED_PARAMS[name], rel=0.01)
    assert cfg.dtype == torch.bfloat16
    # The tokenizer is the tiny one, usable by the engine and the server.
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in d.iterdir()}
    assert resolve_model_dir(name.upper(), cache_dir=tmp_path) == d  # idempotent, any case


def test_bundled_config_details(tmp_path):
    llama = ModelConfig.from_dir(resolve_model_dir("llama-3.1-8b", cache_dir=tmp_path))
    assert (llama.hidden_size, llama.num_layers, llama.num_heads, llama.num_kv_heads,
            llama.intermediate_size, llama.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert (llama.rope.rope_type, llama.rope.factor, llama.rope.low_freq_factor,
            llama.rope.high_freq_factor, llama.rope.original_max_position_embeddings,
            llama.rope.theta) == ("llama3", 8.0, 1.0, 4.0, 8192, 500000.0)
    assert llama.max_position_embeddings == 131072 and not llama.tie_word_embeddings
    qwen = ModelConfig.from_dir(resolve_model_dir("qwen3-8b", cache_dir=tmp_path))
    assert (qwen.num_layers, qwen.head_dim, qwen.intermediate_size, qwen.vocab_size,
            qwen.max_position_embeddings, qwen.rms_norm_eps, qwen.qk_norm) == (
        36, 128, 12288, 151936, 40960, 1e-6, True)
    assert qwen.rope.theta == 1e6 and qwen.sliding_window is None
    small = ModelConfig.from_dir(resolve_model_dir("llama-3.2-1b", cache_dir=tmp_path))
    assert small.tie_word_embeddings and small.rope.factor == 32.0 and small.head_dim == 64
    tiny_qwen = ModelConfig.from_dir(resolve_model_dir("qwen3-0.6b", cache_dir=tmp_path))
    assert tiny_qwen.tie_word_embeddings and (tiny_qwen.num_heads, tiny_qwen.head_dim) == (16, 128)
    assert set(bundled_models()) == set(EXPECTED_PARAMS)


def test_resolve_model_dir_passes_other_paths_through(tmp_path):
    assert resolve_model_dir(EMBEDDED_MODEL) == EMBEDDED_MODEL
    assert resolve_model_dir(tmp_path / "nope") == tmp_path / "nope"
    local = tmp_path / "qwen3-8b"  # an existing directory wins over the bundled name
    local.mkdir()
    assert resolve_model_dir(local) == local


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "llama-3.2-1b"])
def test_checkpoint_shapes_match_transformers(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    d = shrunk_dir(name, tmp_path)
    config = transformers.AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    ours = dict(checkpoint_shapes(ModelConfig.from_dir(d)))
    if config.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight")
    assert ours == hf_shapes


# ---------------------------------------------------------------------------------------------
# Dummy init


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_dummy_init_finite_and_deterministic(name, tmp_path):
    d = shrunk_dir(name, tmp_path)
    cfg = ModelConfig.from_dir(d)
    for dtype in (torch.float32, torch.bfloat16):
        a, b = dummy_model(d, dtype, seed=3), dummy_model(d, dtype, seed=3)
        for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(pa, pb), na
            assert pa.dtype == dtype and torch.isfinite(pa).all(), na
            if na.endswith("norm.weight"):
                assert (pa == 1).all(), na
            else:
                assert 0.01 < pa.float().std() < 0.03, na
        logits = prefill_logits(a, cfg, dtype)
        assert torch.isfinite(logits).all()
        assert torch.equal(logits, prefill_logits(b, cfg, dtype))
    other = dummy_model(d, torch.float32, seed=4)
    assert not torch.equal(dummy_model(d, torch.float32, seed=3).layers[0].mlp.down_proj.weight,
                           other.layers[0].mlp.down_proj.weight)


def test_dummy_logits_finite_through_32_bf16_layers(tmp_path):
    d = shrunk_dir("llama-3.1-8b", tmp_path, num_hidden_layers=32, hidden_size=128,
                   intermediate_size=448)
    logits = prefill_logits(dummy_model(d, torch.bfloat16, 0), ModelConfig.from_dir(d),
                            torch.bfloat16, n=8)
    assert torch.isfinite(logits).all() and logits.float().std() > 0.05


def test_dummy_init_is_layout_independent(tmp_path):
    """A pipeline stage draws only its layers, and gets exactly the single-stage values."""
    d = shrunk_dir("qwen3-8b", tmp_path, num_hidden_layers=4)
    cfg = ModelConfig.from_dir(d)
    full = dummy_model(d, torch.float32, 9)
    stage = LlamaForCausalLM(cfg, Layout(pp_rank=1, pp_size=2), torch.float32)
    init_dummy_weights(stage, 9)
    full_params = dict(full.named_parameters())
    for name, p in stage.named_parameters():
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            name = name.replace(f"layers.{i}.", f"layers.{i + stage.start_layer}.", 1)
        assert torch.equal(p, full_params[name]), name


def test_engine_with_dummy_weights(tmp_path):
    """The integrator's hook: `load_format="dummy"` builds a random model the engine runs."""
    from phaseflip import Engine, SamplingParams
    from phaseflip.model.dummy import copy_tokenizer

    d = shrunk_dir("llama-3.2-1b", tmp_path)
    copy_tokenizer(d)
    with Engine(str(d), load_format="dummy", device="cpu", max_total_tokens=256) as engine:
        out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0,
                                                          ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 4


# ---------------------------------------------------------------------------------------------
# Random checkpoints


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", ROOT / "tools" / "make_random_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_random_checkpoint_loads_in_transformers_and_phaseflip(name, tmp_path):
    transformers = pytest.importorskip("transformers")
    src = shrunk_dir(name, tmp_path / "src")
    out = tmp_path / "ckpt"
    # A tiny shard limit forces several shards and the index.
    _load_tool().main(["--model", str(src), "--out", str(out), "--dtype", "float32",
                       "--shard-gb", "0.00005", "--seed", "5"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    cfg = ModelConfig.from_dir(out)
    assert set(index["weight_map"]) == {n for n, _ in checkpoint_shapes(cfg)}

    loaded = LlamaForCausalLM(cfg, Layout(), torch.float32)
    loaded.load_weights(iter_checkpoint_tensors(out, progress=False))
    # The checkpoint holds the same values as dummy init with the same seed.
    dummy = dummy_model(out, torch.float32, seed=5)
    for (n, a), (_, b) in zip(loaded.named_parameters(), dummy.named_parameters()):
        assert torch.equal(a, b), n

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        ref = hf(ids).logits[0].float()
    assert torch.isfinite(ref).all()
    pos = torch.arange(8)
    batch = ForwardBatch(input_ids=ids[0], positions=pos, out_cache_loc=pos + 1, extend_lens=[8],
                         prefix_lens=[0], kv_indptr=torch.tensor([0, 8]), kv_indices=pos + 1,
                         logits_indices=pos, max_position=7)
    pool = KVPool(9, (0, cfg.num_layers), cfg.num_kv_heads, cfg.head_dim, torch.float32,
                  torch.device("cpu"))
    with torch.inference_mode():
        mine = loaded.compute_logits(loaded(batch, pool, TorchRefAttention())[0])
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_random_checkpoint_single_file_bf16(tmp_path):
    src = shrunk_dir("qwen3-8b", tmp_path / "src")
    out = write_random_checkpoint(src, tmp_path / "ckpt", progress=False)
    assert (out / "model.safetensors").is_file()
    assert not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = dict(iter_checkpoint_tensors(out, progress=False))
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())


# ---------------------------------------------------------------------------------------------
# Benchmark scripts (tiny embedded model, tiny sizes)


def _valid_json(path: Path) -> dict:
    data = json.loads(path.read_text())  # strict: NaN would have been written as null
    assert data["env"]["commit"] and data["env"]["torch"] == torch.__version__
    return data


def test_bench_latency_runs(tmp_path):
    from benchmarks import bench_latency

    out = tmp_path / "lat.json"
    bench_latency.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu", "--batch-sizes", "1,2",
                        "--input-len", "8", "--output-len", "4", "--num-iters", "1",
                        "--num-warmup", "0", "--hf", "--hf-batch-sizes", "1",
                        "--out", str(out)])
    data = _valid_json(out)
    assert data["benchmark"] == "latency" and len(data["results"]) == 2
    for row in data["results"]:
        assert row["prefill_steps_per_iter"] == 1  # the whole batch prefilled in one step
        assert row["decode_step_s"]["n"] == 3  # output 4 = 1 token from prefill + 3 steps
        assert row["prefill_s"] > 0 and 0 < row["mbu_decode"] < 1 and row["mfu_prefill"] > 0
    assert data["results"][0]["hf"]["decode_step_s"]["n"] == 3
    assert data["results"][1]["hf"] is None


@pytest.mark.timeout(180, method="thread")  # gloo ranks: signals cannot interrupt them
def test_bench_latency_records_the_steps_of_a_tp_layout_under_overlap(tmp_path):
    """A TP/PP runner's run-ahead steps enter through `runner.launch`, not `forward`: the
    recorder must see their plans too, or a tp2 row has no decode step at all."""
    from benchmarks import bench_latency

    data = bench_latency.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                               "--batch-sizes", "2", "--input-len", "8", "--output-len", "4",
                               "--num-iters", "1", "--num-warmup", "0",
                               "--engine-arg", "tp_size=2", "--engine-arg",
                               "overlap_schedule=true", "--gpu-busy", "off"])
    (row,) = data["results"]
    assert data["tp_size"] == 2
    assert row["prefill_steps_per_iter"] == 1 and row["decode_step_s"]["n"] == 3


@pytest.mark.parametrize("name", sorted(
    p.stem for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py")
    if "def parse_args" in p.read_text()))
def test_every_benchmark_help_renders(name, capsys):
    """argparse formats help lazily: a stray % in a help string only fails at --help."""
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as done:
        module.parse_args(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


def test_bench_offline_runs(tmp_path):
    from benchmarks import bench_offline

    out = tmp_path / "off.json"
    bench_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu", "--num-prompts", "4",
                        "--dataset", "fixed", "--input-len", "8", "--output-len", "4",
                        "--num-warmup", "1", "--out", str(out)])
    data = _valid_json(out)
    r = data["phaseflip"]
    assert (r["num_requests"], r["input_tokens"], r["output_tokens"]) == (4, 32, 16)
    assert r["total_tokens_per_s"] == pytest.approx(48 / r["duration_s"])
    assert data["gc"]["passes"] >= 0 and data["gc"]["total_ms"] >= 0


def test_gc_pauses_times_each_collection():
    """Every collection inside the region is counted with its generation and time, none
    after it; a full pass lands among the oldest generation's."""
    import gc

    from benchmarks.gc_pauses import GcPauses

    with GcPauses() as pauses:
        gc.collect()
        gc.collect(0)
    gc.collect()
    s = pauses.summary()
    assert s["passes"] == 2 and len(s["oldest_generation_ms"]) == 1
    assert 0 <= s["max_ms"] <= s["total_ms"]


def test_step_stalls_lists_every_step_over_its_threshold(tmp_path):
    """At a 0 ms threshold every step of each run is listed, with the collector's time, the
    allocator's and the compiles inside it (zero on the CPU), in step order."""
    from benchmarks import step_stalls

    out = tmp_path / "stalls.json"
    data = step_stalls.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                             "--num-prompts", "3", "--dataset", "fixed", "--input-len", "8",
                             "--output-len", "3", "--threshold-ms", "0", "--runs", "2",
                             "--out", str(out)])
    assert _valid_json(out)["runs"] == data["runs"] and len(data["runs"]) == 2
    for run in data["runs"]:
        slow = run["slow_steps"]
        assert len(slow) == run["steps"] > 0
        assert [s["step"] for s in slow] == list(range(1, run["steps"] + 1))
        assert all(s["gc_ms"] >= 0 and s["compiled"] >= 0 and s["new_segments"] == 0
                   for s in slow)


def test_bench_offline_partial_run_is_marked(tmp_path):
    from benchmarks import bench_offline

    data = bench_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                               "--num-prompts", "2", "--dataset", "fixed", "--input-len", "4",
                               "--output-len", "4", "--num-warmup", "0",
                               "--max-duration-s", "1e-9"])
    assert data["phaseflip"]["complete"] is False and data["phaseflip"]["num_requests"] == 0


def test_bench_offline_transformers_side_by_side_may_stop_early(tmp_path):
    """--hf-max-duration-s: no batch starts after the deadline (one always runs); the rates
    cover the batches done and say so."""
    from benchmarks import bench_offline

    data = bench_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                               "--num-prompts", "4", "--dataset", "fixed", "--input-len", "4",
                               "--output-len", "3", "--num-warmup", "0", "--hf",
                               "--hf-num-prompts", "4", "--hf-batch-size", "2",
                               "--hf-max-duration-s", "0"])
    hf = data["hf"]
    assert hf["complete"] is False and hf["num_requests"] == 2 and hf["output_tokens"] == 6
    assert data["phaseflip"]["complete"] is True


def test_profile_offline_classifies_every_step(tmp_path):
    from benchmarks import profile_offline

    out = tmp_path / "prof.json"
    data = profile_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                                 "--num-prompts", "6", "--dataset", "fixed", "--input-len", "8",
                                 "--output-len", "5", "--max-running-requests", "4",
                                 "--profile-at", "2", "--profile-steps", "2", "--out", str(out)])
    _valid_json(out)
    kinds = data["by_step_kind"]
    assert set(kinds) <= set(profile_offline.KINDS)
    assert sum(k["steps"] for k in kinds.values()) == len(data["steps"])
    # 6 × 5 tokens: the first of each comes from its prompt step, the rest from one-token rows;
    # the 2 profiled steps (at most 4 rows each) are not in the per-step records
    decode_rows = sum(k["decode_rows"] for k in kinds.values())
    assert 6 * 4 - 2 * 4 <= decode_rows <= 6 * 4
    assert sum(k["prompt_tokens"] for k in kinds.values()) <= 6 * 8


@pytest.mark.timeout(120, method="thread")
def test_bench_plan_broadcast_runs(tmp_path):
    from benchmarks import bench_plan_broadcast

    data = bench_plan_broadcast.main(["--batch-sizes", "1,4", "--context", "16", "--iters", "3",
                                      "--warmup", "1", "--out", str(tmp_path / "b.json")])
    small, big = data["rows"]
    assert small["message_bytes"] < big["message_bytes"]
    assert all(r["rank0_ms"] > 0 and r["rank1_ms"] > 0 for r in data["rows"])


def test_sharegpt_like_lengths_are_seeded_and_clipped():
    from benchmarks.common import sample_lengths

    ins, outs = sample_lengths("sharegpt-like", 2000, 0, 0, seed=0)
    assert (ins, outs) == sample_lengths("sharegpt-like", 2000, 0, 0, seed=0)
    assert 4 <= min(ins) and max(ins) <= 2048 and 4 <= min(outs) and max(outs) <= 1024
    assert 180 < sorted(ins)[1000] < 260 and 150 < sorted(outs)[1000] < 230
    ins, outs = sample_lengths("sharegpt-like", 200, 0, 0, seed=1, max_context=300)
    assert all(i + o <= 300 for i, o in zip(ins, outs))


def test_bench_serving_against_live_server(tmp_path):
    pytest.importorskip("httpx")
    from benchmarks import bench_serving
    from tests.server_process import start_server, stop_server

    proc, url = start_server()
    try:
        out = tmp_path / "serving.json"
        bench_serving.main(["--base-url", url, "--num-prompts", "5", "--request-rate", "50",
                            "--dataset", "fixed", "--input-len", "12", "--output-len", "6",
                            "--out", str(out)])
    finally:
        stop_server(proc)
    data = _valid_json(out)
    assert (data["completed"], data["failed"]) == (5, 0), data["errors"]
    assert data["output_tokens"] == 30 and data["device"] == "cpu"
    # one gap a chunk after the first: 25 with a chunk per token, fewer when a lagging stream
    # got several tokens in one chunk (the front end's join; 22 once on a loaded CI box)
    assert data["ttft_s"]["n"] == 5 and 5 <= data["itl_s"]["n"] <= 25
    assert all(math.isfinite(r["e2e"]) and r["e2e"] >= r["ttft"] for r in data["requests"])


def test_plot_writes_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import bench_offline, plot

    off = tmp_path / "off.json"
    bench_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu", "--num-prompts", "3",
                        "--dataset", "fixed", "--input-len", "4", "--output-len", "2",
                        "--num-warmup", "0", "--out", str(off)])
    written = plot.main([str(off), "--out-dir", str(tmp_path / "figs")])
    assert written and all(p.stat().st_size > 1000 for p in written)


@pytest.mark.timeout(180, method="thread")  # gloo ranks: signals cannot interrupt them
def test_bench_flip_times_each_seam_under_load(tmp_path):
    from benchmarks import bench_flip

    assert bench_flip.parse_args(["--layouts", "tp2,tp2xpp2"]).layouts == [(2, 1), (2, 2)]
    out = tmp_path / "flip.json"
    data = bench_flip.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu", "--dtype",
                            "float32", "--num-prompts", "3", "--dataset", "fixed",
                            "--input-len", "12", "--output-len", "12", "--flip-every", "4",
                            "--layouts", "tp2,pp2", "--hicache-host-gb", "0.01",
                            "--engine-arg", "max_total_tokens=2048", "--out", str(out)])
    _valid_json(out)
    (flip,) = data["flips"]
    assert (flip["source"], flip["target"]) == ("tp2×pp1", "tp1×pp2")
    assert flip["retracted"] == 3 and flip["rows_moved"] == 0
    assert flip["wall_s"] >= flip["total_s"] > 0 and flip["first_step_after_s"] > 0
    assert data["output_tokens"] == 3 * 12


def test_profile_offline_host_clock_times_every_phase(tmp_path):
    """`--host-clock`: each step's host phases by perf_counter, summed by batch band."""
    from benchmarks import profile_offline

    data = profile_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                                 "--num-prompts", "4", "--dataset", "fixed", "--input-len", "8",
                                 "--output-len", "4", "--max-running-requests", "4",
                                 "--host-clock", "--out", str(tmp_path / "hc.json")])
    bands = data["host_clock"]
    assert bands and sum(b["steps"] for b in bands) == len(data["steps"])
    phases = set().union(*(b["host_ms"] for b in bands))
    assert {"schedule", "forward"} <= phases
    assert all(v >= 0 for b in bands for v in b["host_ms"].values())


class _FakeEvent:
    """A CUDA event stand-in: `record` stamps a shared counter, `elapsed_time` subtracts."""

    clock = [0.0]

    def record(self) -> None:
        self.t = self.clock[0]
        self.clock[0] += 1.0

    def elapsed_time(self, other: _FakeEvent) -> float:
        return other.t - self.t


def test_gpu_clock_pairs_each_steps_first_forward_with_its_last_sample():
    """`GpuClock` (profile_offline --gpu-clock) on fake events: a step's span runs from its
    first forward's start to its last sampling call's end; the idle before a step is measured
    from the previous step's end; a step that launched nothing has no pair."""
    from types import SimpleNamespace

    from benchmarks.step_clocks import GpuClock, attach_gpu_times

    runner = SimpleNamespace(forward=lambda: None)
    sampling = SimpleNamespace(sample=lambda: None, sample_ahead=lambda: None)
    clock = GpuClock(SimpleNamespace(runner=runner, sampling=sampling), event=_FakeEvent)
    records = []
    runner.forward()  # start at 0
    _FakeEvent.clock[0] += 3.0
    runner.forward(), sampling.sample_ahead()  # a second forward (PP parts): no new start
    records.append({"gpu_pair": clock.take()})
    records.append({"gpu_pair": clock.take()})  # nothing launched
    _FakeEvent.clock[0] += 5.0
    runner.forward(), sampling.sample(), sampling.sample_ahead()  # 10, (11), 12
    records.append({"gpu_pair": clock.take()})
    runner.forward()
    clock.discard()  # a profiled window's marks
    attach_gpu_times(records, clock)
    assert records[0]["gpu_ms"] == {"span": 4.0, "idle_before": 0.0}
    assert "gpu_ms" not in records[1]
    assert records[2]["gpu_ms"] == {"span": 2.0, "idle_before": 6.0}
    assert len(clock.pairs) == 2


def test_profile_offline_gpu_clock_refuses_the_cpu():
    from benchmarks import profile_offline

    with pytest.raises(SystemExit, match="CUDA"):
        profile_offline.main(["--model", str(EMBEDDED_MODEL), "--device", "cpu",
                              "--num-prompts", "2", "--dataset", "fixed", "--input-len", "4",
                              "--output-len", "2", "--gpu-clock"])
