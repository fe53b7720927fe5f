"""The tiny model shipped in phaseflip/assets/tiny-llama loads and works with plain
transformers, offline (no phaseflip engine involved)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
)

ASSET = Path(__file__).resolve().parents[1] / "phaseflip" / "assets" / "tiny-llama"
REQUIRED = [
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "training_log.json",
    "heldout_sample.txt",
]
MAX_TOTAL_BYTES = 20 * 1024 * 1024


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ASSET, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    m = AutoModelForCausalLM.from_pretrained(ASSET, local_files_only=True)
    m.eval()
    return m


@pytest.fixture(scope="module")
def log():
    return json.loads((ASSET / "training_log.json").read_text())


def test_files_present_and_small():
    for name in REQUIRED:
        assert (ASSET / name).is_file(), name
    total = sum(p.stat().st_size for p in ASSET.rglob("*") if p.is_file())
    assert total <= MAX_TOTAL_BYTES, total


def test_config_is_small_gqa_llama(model):
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.vocab_size == 4096
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.tie_word_embeddings
    assert cfg.max_position_embeddings == 1024
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 10_000_000, n
    raw = json.loads((ASSET / "config.json").read_text())
    assert raw["rope_theta"] == 10000.0


def test_generation_config_eos_are_special_tokens(tok):
    gen = GenerationConfig.from_pretrained(ASSET, local_files_only=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert gen.eos_token_id == [im_end, eot]
    assert gen.bos_token_id == eot and gen.pad_token_id == eot
    specials = set(tok.all_special_ids)
    assert {im_end, eot} <= specials
    assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"


def test_tokenizer_no_bos_and_round_trip(tok):
    text = "Return the value.\n\tdef f(x):  # naïve → ok\n"
    ids = tok(text)["input_ids"]
    assert ids and ids[0] != tok.bos_token_id  # nothing added
    assert tok.decode(ids) == text
    assert tok("<|im_start|>")["input_ids"] == [tok.convert_tokens_to_ids("<|im_start|>")]
    assert len(tok) == 4096


def test_chat_template_renders_two_messages(tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What does len do?"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nWhat does len do?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_prompt == text[: -len("<|im_start|>assistant\n")]


def _greedy(model, tok, prompt: str, n: int) -> str:
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + n
    return tok.decode(out[0, ids["input_ids"].shape[1] :])


def test_greedy_generation_is_printable_and_deterministic(model, tok):
    a = _greedy(model, tok, "Return the", 20)
    b = _greedy(model, tok, "Return the", 20)
    assert a == b
    flat = a.replace("\n", "")
    assert flat.isprintable(), repr(a)
    assert sum(c.isalpha() for c in flat) >= 10, repr(a)  # words, not punctuation noise


def test_heldout_perplexity_matches_log(model, tok, log):
    """Recompute the held-out NLL (the method in training_log.json) on the first windows
    and check the logged per-window sums add up to the reported perplexity."""
    h = log["heldout"]
    text = (ASSET / h["file"]).read_text(encoding="utf-8")
    ids = tok(text, verbose=False)["input_ids"]
    w, n = h["window"], h["windows"]
    assert len(ids) >= n * w
    sums = h["window_nll_sums"]
    assert len(sums) == n and n * (w - 1) == h["predicted_tokens"]
    ppl = math.exp(sum(sums) / h["predicted_tokens"])
    assert ppl == pytest.approx(h["perplexity"], rel=1e-4)
    assert ppl < 100  # trained, not noise (uniform would be 4096)
    k = 8  # recomputing all windows takes too long for a unit test
    x = torch.tensor(ids[: k * w]).view(k, w)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[:, :-1].float(), dim=-1)
    got = (-lp.gather(-1, x[:, 1:, None]).squeeze(-1)).double().sum(dim=1).tolist()
    assert got == pytest.approx(sums[:k], rel=1e-4)
