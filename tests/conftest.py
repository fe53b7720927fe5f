"""Shared fixtures: tiny random checkpoints built with `transformers` (no downloads), and a
`phaseflip serve` of the embedded model with an `openai` client for a test module."""

from __future__ import annotations

import json
import os
import random
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

TEXT = (
    "The quick brown fox jumps over the lazy dog. Return the value of the attribute. "
    "héllo wörld, naïve café — 日本語 🙂. def f(x): return x + 1\n" * 4
)


def build_tokenizer(out: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer trained on a few lines; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    return len(fast)


ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    "llama-tied-mqa": ("LlamaConfig", "LlamaForCausalLM",
                       {"tie_word_embeddings": True, "num_key_value_heads": 1}),
}


def build_model(out: Path, arch: str, dtype: torch.dtype = torch.float32, **over) -> Path:
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    cfg_cls, model_cls, extra = ARCHS[arch]
    kwargs = {
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "initializer_range": 0.2, "eos_token_id": 0,
        "bos_token_id": 0, "tie_word_embeddings": False,
    }
    kwargs.update(extra)
    kwargs.update(over)
    config = getattr(transformers, cfg_cls)(**kwargs)
    torch.manual_seed(1234)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    model.save_pretrained(out, max_shard_size="200KB")
    gen = {"eos_token_id": [0], "bos_token_id": 0}
    (out / "generation_config.json").write_text(json.dumps(gen))
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {a: build_model(root / a, a) for a in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> Path:
    return model_dirs["llama"]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers generate, one prompt at a time (no padding effects). No end
    token: plain argmax at every step, as the engine's ignore_eos (min_new_tokens would mask
    the end token's logit instead, a different choice where it is the argmax)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=max_new_tokens, pad_token_id=0)
        outs.append(g[0, len(p):].tolist())
    return outs


def hf_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """log_softmax of the reference's logits at every position of `ids`: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def prompts_for(vocab: int, seed: int = 0, shared: bool = True) -> list[list[int]]:
    """Prompts of assorted lengths; several share a prefix so the prefix cache gets hits."""
    rng = random.Random(seed)
    base = [rng.randrange(1, vocab) for _ in range(40)]
    out = [[rng.randrange(1, vocab) for _ in range(n)] for n in (1, 5, 17, 33)]
    if shared:
        out += [base[:n] + [rng.randrange(1, vocab) for _ in range(k)]
                for n, k in ((40, 3), (32, 9), (40, 0))]
    return out


@contextmanager
def pp2_losing_a_micro_batch(model_dir, **cfg):
    """A pp2 engine on the CPU with one step scheduled (two prompts), whose plan stage 1 gets
    only the first of its two micro-batches: the defect the named-stall tests provoke.
    Yields (core, the scheduled batch); the ranks are stopped after."""
    from phaseflip import Engine, SamplingParams

    e = Engine(str(model_dir), device="cpu", pp_size=2, **cfg)
    try:
        core = e.core
        for p in prompts_for(300)[:2]:
            core.add_request(f"r{len(p)}", p, SamplingParams(temperature=0, max_new_tokens=2))
        batch = core.scheduler.schedule()
        first_only = batch.plan.split(2)[0]
        core.runner.stage.micro_batches = lambda _plan, _parts=0: [first_only]
        yield core, batch
    finally:
        e.core.runner.close(graceful=False)
        e.core = None


@pytest.fixture
def make_engine():
    """Builds engines and checks at teardown that each one's KV pool balances and is idle."""
    engines = []

    def make(model_dir, **cfg):
        cfg.setdefault("device", os.environ.get("PHASEFLIP_TEST_DEVICE", "cpu"))
        cfg.setdefault("check_accounting", True)
        cfg.setdefault("max_total_tokens", 16384)
        cfg.setdefault("dtype", "float32")  # the oracle comparisons are exact in fp32 only
        from phaseflip import Engine

        e = Engine(str(model_dir), **cfg)
        engines.append(e)
        return e

    yield make
    for e in engines:
        acc = e.pool_accounting()
        assert acc.balanced and acc.private == 0 and acc.protected == 0, acc
        assert not e.core.scheduler.running and not e.core.scheduler.waiting
        assert e.core.kv.table.free_rows == e.core.kv.table.table.shape[0]
        e.shutdown()




@contextmanager
def no_host_reads():
    """Makes every read of a tensor's values by the host raise inside the block (on a GPU each
    is a sync that waits for the stream): `bool(t)`, `t.item()`, `t.tolist()`, `t.cpu()`,
    `t.numpy()`. Code run under it must decide everything from host-side values."""
    def refuse(name: str):
        def read(self, *args, **kwargs):
            raise AssertionError(f"the host read a tensor's values (Tensor.{name})")
        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in ("__bool__", "item", "tolist", "cpu", "numpy"):
            mp.setattr(torch.Tensor, name, refuse(name))
        yield


@pytest.fixture(scope="module")
def runner(llama_dir):
    """One float32 ModelRunner of the tiny Llama (CUDA when present), eager, reference
    attention: the oracle and the model/pool the graph tests capture over."""
    from phaseflip.config import EngineConfig
    from phaseflip.model.config import ModelConfig
    from phaseflip.model.runner import ModelRunner

    cfg = EngineConfig(model=str(llama_dir), device="cuda" if torch.cuda.is_available()
                       else "cpu", dtype="float32", attention_backend="torch",
                       max_total_tokens=512, disable_cuda_graph=True)
    return ModelRunner(cfg, ModelConfig.from_dir(llama_dir))


@pytest.fixture(scope="module")
def server():
    """A real `phaseflip serve` (embedded model, CPU) for the module; it must exit cleanly."""
    from tests.server_process import start_server, stop_server

    proc, url = start_server()
    yield url
    stop_server(proc)
    assert proc.returncode == 0, proc.stdout.read()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
