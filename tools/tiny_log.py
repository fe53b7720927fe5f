"""training_log.json of the tiny model's run: everything needed to reproduce and judge it."""

from __future__ import annotations

import argparse
import hashlib
import platform
import sys

import torch
from tiny_corpus import IM_END, IM_START, MIN_DOC_CHARS, SKIP_DIRS
from tiny_run import (
    EOT,
    HELDOUT_EVERY,
    HELDOUT_WINDOWS,
    SEQ_LEN,
    Corpus,
    Evaluation,
    Heldout,
    Run,
    Tokens,
    Training,
)


def corpus_log(corpus: Corpus) -> dict:
    return {
        **corpus.meta,
        "skip_dirs": sorted(SKIP_DIRS),
        "min_doc_chars": MIN_DOC_CHARS,
        "heldout_rule": f"document index i % {HELDOUT_EVERY} == 0",
        "train_documents": len(corpus.train_docs),
        "train_chat_documents": corpus.n_chat,
        "heldout_documents": len(corpus.held_docs),
    }


def tokenizer_log(tokens: Tokens) -> dict:
    return {
        "type": "byte-level BPE (tokenizers)",
        "vocab_size": tokens.vocab_size,
        "special_tokens": {
            EOT: tokens.eot_id,
            IM_START: tokens.im_start_id,
            IM_END: tokens.im_end_id,
        },
        "train_chars_per_token": round(tokens.chars_per_tok, 3),
    }


MODEL_LOG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
)


def model_log(tr: Training) -> dict:
    return {
        "parameters": tr.n_params,
        **{k: getattr(tr.model.config, k) for k in MODEL_LOG_FIELDS},
        "rope_theta": 10000.0,
        "weights_dtype": "float32",
    }


def training_log(args: argparse.Namespace, tokens: Tokens, tr: Training) -> dict:
    return {
        "steps": tr.steps,
        "planned_steps": tr.total_steps,
        "stopped_early": tr.stopped_early,
        "batch_sequences": args.batch,
        "seq_len": SEQ_LEN,
        "tokens_seen": tr.steps * args.batch * SEQ_LEN,
        "train_tokens": len(tokens.stream),
        "epochs": tr.steps * args.batch / tokens.n_chunks,
        "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), grad clip 1.0",
        "lr_schedule": f"linear warmup {args.warmup} steps to {args.lr}, cosine to 10%",
        "train_seconds": round(tr.train_s, 1),
        "final_train_loss": tr.curve[-1]["loss"] if tr.curve else float("nan"),
        "loss_curve": tr.curve,
    }


def heldout_log(held: Heldout, ev: Evaluation) -> dict:
    return {
        "perplexity": round(ev.ppl, 4),
        "mean_nll_nats": round(ev.mean_nll, 6),
        "predicted_tokens": ev.n_eval,
        "windows": HELDOUT_WINDOWS,
        "window": SEQ_LEN,
        "window_nll_sums": [round(v, 4) for v in ev.window_nll],
        "file": "heldout_sample.txt",
        "file_sha256": hashlib.sha256(held.raw).hexdigest(),
        "method": (
            "ids = tokenizer(open('heldout_sample.txt', encoding='utf-8').read())"
            "['input_ids'] (no bos added; '<|endoftext|>' between documents is the "
            "special token 0); take the first 160*256 ids as 160 non-overlapping "
            "windows of 256; run each window independently (positions 0..255, no "
            "cache); NLL of token t+1 from logits at t for t=0..254 (255 per window, "
            "40,800 in total); perplexity = exp(sum NLL / 40800), float32."
        ),
    }


def build_log(
    run: Run,
    corpus: Corpus,
    tokens: Tokens,
    held: Heldout,
    tr: Training,
    ev: Evaluation,
    samples: list[dict],
    files: dict[str, int],
    wall: float,
) -> dict:
    """Everything needed to reproduce and judge the run (written as training_log.json)."""
    args = run.args
    return {
        "command": "python tools/train_tiny_model.py "
        + " ".join(sys.argv[1:] if run.argv is None else run.argv),
        "reproduce_with": reproduce_command(args, run.defaults, tr.total_steps),
        "steps_source": "timing probe" if args.steps is None else "--steps",
        "args": vars(args),
        "seed": args.seed,
        "corpus": corpus_log(corpus),
        "tokenizer": tokenizer_log(tokens),
        "model": model_log(tr),
        "training": training_log(args, tokens, tr),
        "heldout": heldout_log(held, ev),
        "samples": samples,
        "files_bytes": files,
        "weights_bytes": files.get("model.safetensors", 0),
        "wall_seconds": round(wall, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "platform": platform.platform(),
        "threads": args.threads,
    }


def reproduce_command(args: argparse.Namespace, defaults: dict, total_steps: int) -> str:
    """The command line that repeats this run exactly (every hyper-parameter that differs
    from its default, and the step count actually planned)."""
    parts = [f"--out {args.out}", f"--seed {args.seed}", f"--steps {total_steps}"]
    for k, v in vars(args).items():
        if k in ("out", "seed", "steps", "max_minutes") or v == defaults[k]:
            continue
        parts.append(f"--{k.replace('_', '-')} {v}")
    return "python tools/train_tiny_model.py " + " ".join(parts)

