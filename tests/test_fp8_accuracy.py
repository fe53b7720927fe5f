"""FP8 accuracy, stated and held (issue 19 item 3): prompt logprobs and greedy agreement of FP8
engines against the float32 engine, on the embedded model (its held-out text) and on random
weights of Llama-3.1-8B's layer shapes (2 layers, vocab cut to the bundled tokenizer's 4096).

The bounds sit above the measured values (docs/quantization.md has the table and the
command) with room for nothing but noise: FP8 KV alone must stay below 0.02 mean |dlogprob|
on the embedded model (the issue's target), and each variant must still agree on the greedy
token at most prompt positions.
"""

from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.fp8_accuracy import VARIANTS, compare, embedded_prompts, id_prompts
from phaseflip.config import EMBEDDED_MODEL
from phaseflip.model.bundled import TOKENIZER_DIR, TOKENIZER_FILES, resolve_model_dir
from phaseflip.model.loader import load_tokenizer

pytestmark = pytest.mark.timeout(600, method="thread")

BASE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 8192}
# variant: (mean |dlogprob| bound, least top-1 agreement); measured 0.0227 / 0.0181 / 0.0288,
# and with the LM head in FP8 too (`--fp8-lm-head`) 0.0367, top-1 95.9 %
EMBEDDED_BOUNDS = {"w8": (0.03, 0.95), "kv8": (0.02, 0.95), "w8kv8": (0.04, 0.95),
                   "w8kv8lm8": (0.045, 0.95)}


@pytest.fixture(scope="module")
def prompts():
    return embedded_prompts(load_tokenizer(EMBEDDED_MODEL), n=16, length=96)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_embedded_model(variant, prompts):
    report = compare(BASE, {**BASE, **VARIANTS[variant]}, prompts, max_new=16)
    mean_bound, top1 = EMBEDDED_BOUNDS[variant]
    assert report.scored_tokens == 16 * 95
    assert 0 < report.mean_abs_dlogprob < mean_bound, report
    assert report.top1_agreement >= top1, report


def small_8b_dir(root) -> str:
    """Llama-3.1-8B's config with 1 layer and the bundled tokenizer's vocabulary."""
    raw = json.loads((resolve_model_dir("llama-3.1-8b") / "config.json").read_text())
    raw.update(num_hidden_layers=1, vocab_size=4096, bos_token_id=0, eos_token_id=0)
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw))
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).is_file():
            shutil.copyfile(TOKENIZER_DIR / name, root / name)
    return str(root)


def test_8b_shaped_random_weights(tmp_path):
    """Both FP8 variants together on 8B-shaped layers (hidden 4096, 32/8 heads of 128,
    intermediate 14336). Untrained N(0, 0.02^2) weights have nearly flat logits and none of a
    trained model's tolerance: measured 0.20 mean |dlogprob| for w8kv8 (w8 0.19, kv8 0.068,
    and bf16 itself 0.017 from float32: FP8's 3 mantissa bits against bf16's 7; two layers,
    docs/quantization.md), so greedy tokens flip often; the bound catches a misapplied scale
    (deltas of whole nats), not noise. One layer here, to keep the suite fast."""
    base = {**BASE, "model": small_8b_dir(tmp_path / "m"), "load_format": "dummy",
            "max_total_tokens": 2048}
    report = compare(base, {**base, **VARIANTS["w8kv8"]}, id_prompts(4096, n=4, length=32),
                     max_new=4)
    assert 0 < report.mean_abs_dlogprob < 0.3, report
