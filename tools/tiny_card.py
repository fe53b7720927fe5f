"""What the tiny model's directory says about itself: tokenizer fields that older
`transformers` versions read, and the model card (README.md) written from the training log."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_corpus import CHAT_TEMPLATE, IM_END, IM_START


def add_compat_fields(out: Path) -> None:
    """Make the saved files readable by older transformers (4.5x) and by engines that read
    the JSON directly: top-level ``rope_theta`` in config.json; ``tokenizer_class``
    PreTrainedTokenizerFast, the chat template and ``additional_special_tokens`` in
    tokenizer_config.json (transformers 5 also writes chat_template.jinja)."""
    cfg_p = out / "config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_p = out / "tokenizer_config.json"
    tc = json.loads(tc_p.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE
    tc["additional_special_tokens"] = [IM_START, IM_END]
    tc["add_bos_token"] = False
    tc["add_eos_token"] = False
    tc_p.write_text(json.dumps(tc, indent=2) + "\n")


def write_card(out: Path, log: dict, heldout_every: int, chat_sample: str) -> None:
    """Write README.md (the model card) from the training log."""
    sections = [
        _card_intro(log),
        _card_how_made(log),
        _card_corpus(log, heldout_every),
        _card_tokenizer(log),
        _card_architecture(log),
        _card_training(log),
        _card_heldout(log),
        "## Sample greedy completions (transformers `generate`, `do_sample=False`)\n\n"
        + _card_samples(log["samples"], chat_sample)
        + "\n",
        "## Files\n\n" + _card_file_list(out) + "\n",
    ]
    (out / "README.md").write_text("\n".join(sections))


def _card_intro(log: dict) -> str:
    m, t = log["model"], log["training"]
    return f"""---
license: psf-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [llama, toy, test-fixture]
---

# tiny-llama (phaseflip test/demo model)

**This is a toy.** A {m["parameters"] / 1e6:.2f} M-parameter Llama-architecture model trained for
{t["train_seconds"] / 60:.1f} minutes on 2 CPU cores. It exists so that `phaseflip serve` and
the test suite run with no download and print recognisable (English-ish, Python-docstring-ish)
text instead of noise. It knows nothing useful, repeats itself, and must not be used for
anything but tests and demos.
"""


def _card_how_made(log: dict) -> str:
    t = log["training"]
    steps_note = (
        "the step count was chosen by a timing probe and is fixed by `--steps` above."
        if log.get("steps_source") == "timing probe"
        else "the step count was given with `--steps`."
    )
    stop_note = (
        f"**the max-minutes safety stop triggered after {t['steps']} of {t['planned_steps']} "
        "steps, so the command above would train longer than this model was**"
        if t["stopped_early"]
        else "the --max-minutes budget is only a safety stop and did not trigger"
    )
    return f"""## How it was made

```
{log["reproduce_with"]}
```

(Actual invocation: `{log["command"]}`; {steps_note} The command above is deterministic given
the seed, the Python standard library version, the thread count and the library versions
below; {stop_note}) Python {log["python"]},
torch {log["torch"]}, transformers {log["transformers"]}, tokenizers {log["tokenizers"]},
{log["threads"]} threads, total wall time {log["wall_seconds"] / 60:.1f} min.
"""


def _card_corpus(log: dict, heldout_every: int) -> str:
    t, c = log["training"], log["corpus"]
    return f"""## Corpus

Docstrings (via `ast`) and comments (via `tokenize`, consecutive comment lines grouped) of
the Python {log["python"]} standard library (`sysconfig.get_paths()["stdlib"]`), walked in
sorted order, skipping directories {", ".join(c["skip_dirs"])}. Whitespace cleaned, documents
shorter than {c["min_doc_chars"]} characters and exact duplicates dropped:
{c["documents"]:,} documents, {c["chars"] / 1e6:.2f} M characters from {c["files_parsed"]} files.
Held out: every {heldout_every}th document ({c["heldout_rule"]}), {c["heldout_documents"]:,}
documents, never used for the tokenizer or training. Of the {c["train_documents"]:,} training
documents, {c["train_chat_documents"]:,} named function/class docstrings (a deterministic
hash-selected ~{log["args"]["chat_frac"]:.0%}) were written as a ChatML exchange
(`<|im_start|>user\\nWhat does NAME do?<|im_end|>\\n<|im_start|>assistant\\nDOCSTRING<|im_end|>\\n`)
so the model has seen the chat format and learns to stop with `<|im_end|>`.
Training text is packed into {t["seq_len"]}-token sequences with `<|endoftext|>` between documents.
"""


def _card_tokenizer(log: dict) -> str:
    return f"""## Tokenizer

Byte-level BPE (`tokenizers`), vocabulary {log["tokenizer"]["vocab_size"]}, trained on the training
split. Special tokens: `<|endoftext|>` = 0 (bos, eos and pad), `<|im_start|>` = 1,
`<|im_end|>` = 2. `tokenizer(text)["input_ids"]` is exactly the BPE encoding of `text` —
**no bos or eos is added**; special-token strings inside the text are encoded as their ids.
`decode(encode(text)) == text` for any text (byte-level). A ChatML `chat_template` is included:
`<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n` per message, plus `<|im_start|>assistant\\n`
with `add_generation_prompt=True` (no system message is inserted automatically).
"""


def _card_architecture(log: dict) -> str:
    m = log["model"]
    return f"""## Architecture

`LlamaForCausalLM`: hidden {m["hidden_size"]}, {m["num_hidden_layers"]} layers,
{m["num_attention_heads"]} attention heads, {m["num_key_value_heads"]} KV heads (GQA, head dim
{m["hidden_size"] // m["num_attention_heads"]}), MLP intermediate {m["intermediate_size"]} (SwiGLU),
RMSNorm eps 1e-5, RoPE theta {m["rope_theta"]:.0f}, max positions {m["max_position_embeddings"]},
vocabulary {m["vocab_size"]}, tied input/output embeddings. **{m["parameters"]:,} parameters**,
stored in **{m["weights_dtype"]}** (`model.safetensors`, {log["weights_bytes"] / 1e6:.2f} MB).
`generation_config.json`: eos `[2, 0]` (`<|im_end|>`, `<|endoftext|>`), bos 0, pad 0, greedy.
"""


def _card_training(log: dict) -> str:
    t = log["training"]
    final_loss = t["final_train_loss"]
    return f"""## Training

Plain PyTorch loop, AdamW (betas 0.9/0.95, weight decay {log["args"]["weight_decay"]} on
matrices), grad-norm clip 1.0, {t["lr_schedule"]}, {t["steps"]} steps x {t["batch_sequences"]}
sequences x {t["seq_len"]} tokens = {t["tokens_seen"]:,} tokens ({t["epochs"]:.2f} epochs of
{t["train_tokens"]:,} training tokens), fp32, seed {log["seed"]}, {t["train_seconds"] / 60:.1f} min.
Final training loss (mean of the last {log["args"]["log_every"]} steps): **{final_loss:.3f}**.
The full loss curve is in `training_log.json`.
"""


def _card_heldout(log: dict) -> str:
    h = log["heldout"]
    return f"""## Held-out perplexity

**{h["perplexity"]:.2f}** (mean NLL {h["mean_nll_nats"]:.4f} nats/token) on `heldout_sample.txt`
(the exact text, sha256 `{h["file_sha256"][:16]}…`). Method: {h["method"]}
"""


def _card_samples(samples: list[dict], chat_sample: str) -> str:
    """Each sample as a fenced block; plain prompts are shown followed by their completion."""
    return "\n\n".join(
        f"**Prompt** `{s['prompt']!r}` → greedy:\n\n```\n{s['prompt'] if not s.get('chat') else ''}"
        f"{s['completion']}\n```"
        if not s.get("chat")
        else f"**Chat** (template applied, `add_generation_prompt=True`) user: "
        f"`{chat_sample}` → greedy assistant reply:\n\n```\n{s['completion']}\n```"
        for s in samples
    )


def _card_file_list(out: Path) -> str:
    """The directory listing with sizes; README.md (being written) is listed without one."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    files["README.md"] = 0
    return "\n".join(
        f"- `{k}`" + (f" — {v:,} bytes" if k != "README.md" else "") for k, v in files.items()
    )
