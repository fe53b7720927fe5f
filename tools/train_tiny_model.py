#!/usr/bin/env python
"""Train the tiny Llama-architecture model that ships with phaseflip.

The model is a *toy*: a few million parameters, trained for a few minutes on two CPU
cores, on text every Python installation has (the docstrings and comments of the
standard library).  Its only purpose is to let ``phaseflip serve`` and the test suite
run with no download while producing recognisable (English-ish, Python-ish) text.

Usage::

    python tools/train_tiny_model.py --out phaseflip/assets/tiny-llama --seed 0 \
        [--max-minutes 18] [--steps N]

Everything is deterministic given ``--seed`` and ``--steps`` (sorted file order,
seeded shuffles, fixed thread count).  Without ``--steps`` the number of steps is
chosen from a short timing probe so that training fits in ``--max-minutes``; the
chosen value is written to ``training_log.json`` so the run can be repeated exactly
with ``--steps``.

Outputs (a Hugging Face model directory): config.json, model.safetensors,
generation_config.json, tokenizer files (with a ChatML chat template), README.md
(model card), training_log.json and heldout_sample.txt (the exact held-out text the
reported perplexity was computed on).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

# Keep the BPE trainer (rayon) from grabbing every core of a shared machine.
os.environ.setdefault("RAYON_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from tiny_card import add_compat_fields, write_card  # noqa: E402
from tiny_corpus import (  # noqa: E402
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    MIN_DOC_CHARS,
    SKIP_DIRS,
    build_corpus,
    to_training_text,
)

EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2


HELDOUT_EVERY = 20  # document i is held out iff i % HELDOUT_EVERY == 0
SEQ_LEN = 256
HELDOUT_WINDOWS = 160  # 160 x 256 = 40,960 evaluation tokens
HELDOUT_MAX_BYTES = 200_000

SAMPLE_PROMPTS = [
    "Return the",
    "This module provides",
    "If the file does not exist,",
    "The default value is",
    "Raise ValueError if",
]
CHAT_SAMPLE = "What does os.path.join do?"


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # No post-processor: tokenizer(text) adds no bos/eos.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        add_bos_token=False,
        add_eos_token=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# --------------------------------------------------------------------------- model


def make_model(args, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(cfg)


def lr_at(step: int, total: int, warmup: int, peak: float, floor_frac: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_frac + (1 - floor_frac) * 0.5 * (1 + math.cos(math.pi * prog)))


@torch.no_grad()
def heldout_perplexity(model, ids: list[int], n_windows: int):
    """exp(mean next-token NLL) over non-overlapping SEQ_LEN windows of ``ids``.

    Window w is ids[w*256:(w+1)*256], evaluated independently (fresh context, position
    0 at its first token); each window contributes 255 predictions (tokens 1..255 given
    their prefix).  Returns (ppl, mean_nll, n_predicted_tokens, per-window NLL sums)."""
    model.eval()
    x = torch.tensor(ids[: n_windows * SEQ_LEN], dtype=torch.long).view(n_windows, SEQ_LEN)
    per_window: list[float] = []
    for batch in x.split(16):
        logits = model(input_ids=batch).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        nll = -lp.gather(-1, batch[:, 1:, None]).squeeze(-1)
        per_window.extend(nll.double().sum(dim=1).tolist())
    model.train()
    count = n_windows * (SEQ_LEN - 1)
    mean = sum(per_window) / count
    return math.exp(mean), mean, count, per_window


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="phaseflip/assets/tiny-llama")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="fix the number of steps")
    ap.add_argument("--max-minutes", type=float, default=18.0, help="training time budget")
    ap.add_argument("--batch", type=int, default=16, help="sequences of 256 tokens per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--max-corpus-mb", type=float, default=12.0)
    ap.add_argument("--chat-frac", type=float, default=0.15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--log-every", type=int, default=20)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- corpus
    docs, corpus_meta = build_corpus(int(args.max_corpus_mb * 1e6))
    train_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != 0]
    held_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == 0]
    train_texts = [to_training_text(d, args.chat_frac) for d in train_docs]
    n_chat = sum(t.startswith(IM_START) for t in train_texts)
    say(
        f"corpus: {corpus_meta['files_parsed']} files, {len(docs)} docs, "
        f"{corpus_meta['chars'] / 1e6:.2f} M chars; train {len(train_docs)} "
        f"({n_chat} as ChatML), held-out {len(held_docs)}"
    )

    # ---- tokenizer (trained on the training split only, plain text)
    tok = train_tokenizer([d["text"] for d in train_docs], args.vocab)
    hf_tok = wrap_tokenizer(tok)
    eot_id = hf_tok.convert_tokens_to_ids(EOT)
    im_start_id = hf_tok.convert_tokens_to_ids(IM_START)
    im_end_id = hf_tok.convert_tokens_to_ids(IM_END)
    assert (eot_id, im_start_id, im_end_id) == (0, 1, 2), (eot_id, im_start_id, im_end_id)
    vocab_size = tok.get_vocab_size()
    probe = "Return the value of x.  Ünïcødé → ok\n\tdef f(): pass"
    assert hf_tok.decode(hf_tok(probe)["input_ids"]) == probe
    say(f"tokenizer: vocab {vocab_size}")

    # ---- token streams
    enc = tok.encode_batch(train_texts, add_special_tokens=False)
    stream: list[int] = []
    for e in enc:
        stream.extend(e.ids)
        stream.append(eot_id)
    n_chunks = len(stream) // SEQ_LEN
    data = torch.tensor(stream[: n_chunks * SEQ_LEN], dtype=torch.long).view(n_chunks, SEQ_LEN)
    chars_per_tok = sum(len(t) for t in train_texts) / len(stream)
    say(
        f"train tokens {len(stream):,} -> {n_chunks:,} sequences of {SEQ_LEN}; "
        f"{chars_per_tok:.2f} chars/token"
    )

    # held-out sample: held-out docs (plain text) joined by <|endoftext|>, until it has
    # enough tokens for HELDOUT_WINDOWS windows.
    need = HELDOUT_WINDOWS * SEQ_LEN
    parts: list[str] = []
    n_ids = 0
    for d in held_docs:
        parts.append(d["text"])
        n_ids += len(tok.encode(d["text"]).ids) + 1
        if n_ids >= need + 1:
            break
    held_text = EOT.join(parts) + EOT
    held_ids = hf_tok(held_text, verbose=False)["input_ids"]
    assert len(held_ids) >= need, (len(held_ids), need)
    held_bytes = held_text.encode("utf-8")
    assert len(held_bytes) < HELDOUT_MAX_BYTES, len(held_bytes)
    (out / "heldout_sample.txt").write_bytes(held_bytes)
    say(
        f"held-out sample: {len(parts)} docs, {len(held_bytes):,} bytes, "
        f"{len(held_ids):,} tokens, evaluating first {need:,}"
    )

    # ---- model
    model = make_model(args, vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"model: {n_params:,} parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    g = torch.Generator().manual_seed(args.seed)
    order: list[int] = []

    def next_batch() -> torch.Tensor:
        nonlocal order
        if len(order) < args.batch:
            order = order + torch.randperm(n_chunks, generator=g).tolist()
        idx, order = order[: args.batch], order[args.batch :]
        return data[idx]

    def train_step(step: int, total: int) -> float:
        lr = lr_at(step, total, args.warmup, args.lr, 0.1)
        for grp in opt.param_groups:
            grp["lr"] = lr
        batch = next_batch()
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    model.train()
    budget_s = args.max_minutes * 60
    t_train0 = time.time()
    curve: list[dict] = []
    step = 0
    if args.steps is None:
        # Timing probe: the first steps are real training steps (warmup schedule for a
        # provisional total); the total is then fixed from the measured speed.
        probe_steps = 8
        provisional = 10_000
        losses = []
        for step in range(probe_steps):
            losses.append(train_step(step, provisional))
        per_step = (time.time() - t_train0) / probe_steps
        total_steps = max(probe_steps + 1, int(budget_s * 0.93 / per_step))
        step = probe_steps
        say(
            f"timing probe: {per_step:.2f} s/step -> {total_steps} steps "
            f"(re-run with --steps {total_steps} to reproduce)"
        )
        curve.append(
            {
                "step": probe_steps,
                "loss": sum(losses) / len(losses),
                "lr": lr_at(probe_steps - 1, total_steps, args.warmup, args.lr, 0.1),
                "elapsed_s": round(time.time() - t_train0, 1),
            }
        )
        # Note: the probe steps used a warmup computed for the provisional total, which
        # is identical (warmup only depends on the step index) as long as total > warmup.
    else:
        total_steps = args.steps

    acc = 0.0
    acc_n = 0
    stopped_early = False
    while step < total_steps:
        acc += train_step(step, total_steps)
        acc_n += 1
        step += 1
        if step % args.log_every == 0 or step == total_steps:
            elapsed = time.time() - t_train0
            rec = {
                "step": step,
                "loss": round(acc / acc_n, 4),
                "lr": round(lr_at(step - 1, total_steps, args.warmup, args.lr, 0.1), 6),
                "elapsed_s": round(elapsed, 1),
            }
            curve.append(rec)
            eta = elapsed / step * (total_steps - step)
            say(
                f"step {step:5d}/{total_steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                f"eta {eta / 60:.1f} min"
            )
            acc, acc_n = 0.0, 0
        if time.time() - t_train0 > budget_s * 1.15 and step < total_steps:
            say(f"!! over the time budget, stopping at step {step}")
            stopped_early = True
            break
    train_s = time.time() - t_train0
    final_loss = curve[-1]["loss"] if curve else float("nan")

    # ---- evaluation
    ppl, mean_nll, n_eval, window_nll = heldout_perplexity(model, held_ids, HELDOUT_WINDOWS)
    say(f"held-out perplexity {ppl:.3f} (mean NLL {mean_nll:.4f} nats over {n_eval} tokens)")

    # ---- save
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gen = GenerationConfig(
        bos_token_id=eot_id,
        eos_token_id=[im_end_id, eot_id],
        pad_token_id=eot_id,
        do_sample=False,
        max_new_tokens=64,
    )
    gen.save_pretrained(out)
    add_compat_fields(out)

    # ---- reload from disk (offline) and produce sample completions
    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out)
    model2.eval()
    ppl2, _, _, _ = heldout_perplexity(
        model2, tok2(held_text, verbose=False)["input_ids"], HELDOUT_WINDOWS
    )
    assert abs(ppl2 - ppl) < 1e-3 * ppl, (ppl, ppl2)

    samples = []
    with torch.no_grad():
        for p in SAMPLE_PROMPTS:
            ids = tok2(p, return_tensors="pt")
            o = model2.generate(**ids, max_new_tokens=40, do_sample=False)
            samples.append(
                {"prompt": p, "completion": tok2.decode(o[0, ids["input_ids"].shape[1] :])}
            )
        chat = tok2.apply_chat_template(
            [{"role": "user", "content": CHAT_SAMPLE}],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = tok2(chat, return_tensors="pt")
        o = model2.generate(**ids, max_new_tokens=60, do_sample=False)
        samples.append(
            {
                "prompt": chat,
                "chat": True,
                "completion": tok2.decode(o[0, ids["input_ids"].shape[1] :]),
            }
        )
    for s in samples:
        say(f"sample {s['prompt']!r} -> {s['completion']!r}")

    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    weights_bytes = files.get("model.safetensors", 0)
    wall = time.time() - t_start
    log = {
        "command": "python tools/train_tiny_model.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "reproduce_with": reproduce_command(args, total_steps),
        "steps_source": "timing probe" if args.steps is None else "--steps",
        "args": vars(args),
        "seed": args.seed,
        "corpus": {
            **corpus_meta,
            "skip_dirs": sorted(SKIP_DIRS),
            "min_doc_chars": MIN_DOC_CHARS,
            "heldout_rule": f"document index i % {HELDOUT_EVERY} == 0",
            "train_documents": len(train_docs),
            "train_chat_documents": n_chat,
            "heldout_documents": len(held_docs),
        },
        "tokenizer": {
            "type": "byte-level BPE (tokenizers)",
            "vocab_size": vocab_size,
            "special_tokens": {EOT: eot_id, IM_START: im_start_id, IM_END: im_end_id},
            "train_chars_per_token": round(chars_per_tok, 3),
        },
        "model": {
            "parameters": n_params,
            **{
                k: getattr(model.config, k)
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "max_position_embeddings",
                    "vocab_size",
                    "tie_word_embeddings",
                )
            },
            "rope_theta": 10000.0,
            "weights_dtype": "float32",
        },
        "training": {
            "steps": step,
            "planned_steps": total_steps,
            "stopped_early": stopped_early,
            "batch_sequences": args.batch,
            "seq_len": SEQ_LEN,
            "tokens_seen": step * args.batch * SEQ_LEN,
            "train_tokens": len(stream),
            "epochs": step * args.batch / n_chunks,
            "optimizer": "AdamW(betas=(0.9, 0.95), eps=1e-8), grad clip 1.0",
            "lr_schedule": f"linear warmup {args.warmup} steps to {args.lr}, cosine to 10%",
            "train_seconds": round(train_s, 1),
            "final_train_loss": final_loss,
            "loss_curve": curve,
        },
        "heldout": {
            "perplexity": round(ppl, 4),
            "mean_nll_nats": round(mean_nll, 6),
            "predicted_tokens": n_eval,
            "windows": HELDOUT_WINDOWS,
            "window": SEQ_LEN,
            "window_nll_sums": [round(v, 4) for v in window_nll],
            "file": "heldout_sample.txt",
            "file_sha256": hashlib.sha256(held_bytes).hexdigest(),
            "method": (
                "ids = tokenizer(open('heldout_sample.txt', encoding='utf-8').read())"
                "['input_ids'] (no bos added; '<|endoftext|>' between documents is the "
                "special token 0); take the first 160*256 ids as 160 non-overlapping "
                "windows of 256; run each window independently (positions 0..255, no "
                "cache); NLL of token t+1 from logits at t for t=0..254 (255 per window, "
                "40,800 in total); perplexity = exp(sum NLL / 40800), float32."
            ),
        },
        "samples": samples,
        "files_bytes": files,
        "weights_bytes": weights_bytes,
        "wall_seconds": round(wall, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "platform": platform.platform(),
        "threads": args.threads,
    }
    (out / "training_log.json").write_text(json.dumps(log, indent=2, ensure_ascii=False) + "\n")
    write_card(out, log, HELDOUT_EVERY, CHAT_SAMPLE)
    say(f"done in {wall / 60:.1f} min; weights {weights_bytes / 1e6:.2f} MB")
    return 0


def reproduce_command(args, total_steps: int) -> str:
    """The command line that repeats this run exactly (every hyper-parameter that differs
    from its default, and the step count actually planned)."""
    defaults = vars(build_parser().parse_args([]))
    parts = [f"--out {args.out}", f"--seed {args.seed}", f"--steps {total_steps}"]
    for k, v in vars(args).items():
        if k in ("out", "seed", "steps", "max_minutes") or v == defaults[k]:
            continue
        parts.append(f"--{k.replace('_', '-')} {v}")
    return "python tools/train_tiny_model.py " + " ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
