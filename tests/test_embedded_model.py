"""The shipped tiny model through the engine: default everywhere, deterministic, printable, and
the engine's held-out perplexity equals the training script's figure."""

from __future__ import annotations

import json
import math

import pytest

from phaseflip import Engine, SamplingParams
from phaseflip.config import EMBEDDED_MODEL


@pytest.fixture(scope="module")
def engine():
    with Engine(device="cpu", dtype="float32", max_total_tokens=70000) as e:
        yield e


def test_engine_defaults_to_embedded_model(engine):
    assert engine.config.model == str(EMBEDDED_MODEL)
    assert engine.model_config.architecture == "LlamaForCausalLM"


def test_greedy_completions_are_deterministic_printable_text(engine):
    prompts = ["Return the", "If the file does not exist,", "This module provides"]
    params = SamplingParams(temperature=0.0, max_new_tokens=24)
    first = engine.generate(prompts, params, use_tqdm=False)
    second = engine.generate(prompts, params, use_tqdm=False)
    for a, b in zip(first, second):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.text.strip() and a.text.replace("\n", "").isprintable()
        words = [w for w in a.text.split() if w.isalpha()]
        assert len(words) >= 3, a.text  # words, not byte noise


def test_heldout_perplexity_matches_training_log(engine):
    log = json.loads((EMBEDDED_MODEL / "training_log.json").read_text())["heldout"]
    text = (EMBEDDED_MODEL / log["file"]).read_text(encoding="utf-8")
    ids = engine.tokenizer(text)["input_ids"]
    w, n = log["window"], log["windows"]
    windows = [ids[i * w : (i + 1) * w] for i in range(n)]
    outs = engine.generate(windows, SamplingParams(max_new_tokens=0, prompt_logprobs=0),
                           use_tqdm=False)
    sums = [-sum(o.prompt_logprobs[1:]) for o in outs]
    assert sums == pytest.approx(log["window_nll_sums"], rel=1e-4)
    ppl = math.exp(sum(sums) / log["predicted_tokens"])
    assert ppl == pytest.approx(log["perplexity"], rel=1e-4)
