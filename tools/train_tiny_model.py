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
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

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
    build_corpus,
    to_training_text,
)
from tiny_log import build_log  # noqa: E402
from tiny_run import (  # noqa: E402
    CHAT_SAMPLE,
    EOT,
    HELDOUT_EVERY,
    HELDOUT_MAX_BYTES,
    HELDOUT_WINDOWS,
    SAMPLE_PROMPTS,
    SEQ_LEN,
    SPECIAL_TOKENS,
    Corpus,
    Evaluation,
    Heldout,
    Run,
    Tokens,
    Training,
)

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




# --------------------------------------------------------------------------- phases


def start_run(argv: list[str] | None) -> Run:
    """Parse the arguments, then fix threads and seeds before anything draws a random number."""
    args = build_parser().parse_args(argv)
    t_start = time.time()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return Run(args, argv, out, t_start, vars(build_parser().parse_args([])))


def load_corpus(run: Run) -> Corpus:
    """Build the corpus and split it into training and held-out documents."""
    docs, meta = build_corpus(int(run.args.max_corpus_mb * 1e6))
    train_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != 0]
    held_docs = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == 0]
    train_texts = [to_training_text(d, run.args.chat_frac) for d in train_docs]
    n_chat = sum(t.startswith(IM_START) for t in train_texts)
    run.say(
        f"corpus: {meta['files_parsed']} files, {len(docs)} docs, "
        f"{meta['chars'] / 1e6:.2f} M chars; train {len(train_docs)} "
        f"({n_chat} as ChatML), held-out {len(held_docs)}"
    )
    return Corpus(meta, train_docs, held_docs, train_texts, n_chat)


def fit_tokenizer(run: Run, corpus: Corpus) -> tuple[Any, Any, tuple[int, int, int]]:
    """Train the BPE on the training split only (plain text) and check its special ids.
    Returns (tokenizer, its transformers wrapper, ids of EOT, IM_START, IM_END)."""
    tok = train_tokenizer([d["text"] for d in corpus.train_docs], run.args.vocab)
    hf_tok = wrap_tokenizer(tok)
    eot_id = hf_tok.convert_tokens_to_ids(EOT)
    im_start_id = hf_tok.convert_tokens_to_ids(IM_START)
    im_end_id = hf_tok.convert_tokens_to_ids(IM_END)
    assert (eot_id, im_start_id, im_end_id) == (0, 1, 2), (eot_id, im_start_id, im_end_id)
    probe = "Return the value of x.  Ünïcødé → ok\n\tdef f(): pass"
    assert hf_tok.decode(hf_tok(probe)["input_ids"]) == probe
    run.say(f"tokenizer: vocab {tok.get_vocab_size()}")
    return tok, hf_tok, (eot_id, im_start_id, im_end_id)


def tokenize_corpus(run: Run, corpus: Corpus) -> Tokens:
    """Fit the tokenizer, then pack the training texts into SEQ_LEN-token sequences."""
    tok, hf_tok, (eot_id, im_start_id, im_end_id) = fit_tokenizer(run, corpus)
    enc = tok.encode_batch(corpus.train_texts, add_special_tokens=False)
    stream: list[int] = []
    for e in enc:
        stream.extend(e.ids)
        stream.append(eot_id)
    n_chunks = len(stream) // SEQ_LEN
    data = torch.tensor(stream[: n_chunks * SEQ_LEN], dtype=torch.long).view(n_chunks, SEQ_LEN)
    chars_per_tok = sum(len(t) for t in corpus.train_texts) / len(stream)
    run.say(
        f"train tokens {len(stream):,} -> {n_chunks:,} sequences of {SEQ_LEN}; "
        f"{chars_per_tok:.2f} chars/token"
    )
    return Tokens(
        tok=tok,
        hf_tok=hf_tok,
        vocab_size=tok.get_vocab_size(),
        eot_id=eot_id,
        im_start_id=im_start_id,
        im_end_id=im_end_id,
        stream=stream,
        data=data,
        chars_per_tok=chars_per_tok,
    )


def write_heldout(run: Run, corpus: Corpus, tokens: Tokens) -> Heldout:
    """Held-out docs (plain text) joined by <|endoftext|>, until there are enough tokens for
    HELDOUT_WINDOWS windows; written to heldout_sample.txt so the perplexity can be redone."""
    need = HELDOUT_WINDOWS * SEQ_LEN
    parts: list[str] = []
    n_ids = 0
    for d in corpus.held_docs:
        parts.append(d["text"])
        n_ids += len(tokens.tok.encode(d["text"]).ids) + 1
        if n_ids >= need + 1:
            break
    held_text = EOT.join(parts) + EOT
    held_ids = tokens.hf_tok(held_text, verbose=False)["input_ids"]
    assert len(held_ids) >= need, (len(held_ids), need)
    held_bytes = held_text.encode("utf-8")
    assert len(held_bytes) < HELDOUT_MAX_BYTES, len(held_bytes)
    (run.out / "heldout_sample.txt").write_bytes(held_bytes)
    run.say(
        f"held-out sample: {len(parts)} docs, {len(held_bytes):,} bytes, "
        f"{len(held_ids):,} tokens, evaluating first {need:,}"
    )
    return Heldout(held_text, held_ids, held_bytes)


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


class Trainer:
    """One optimizer step at a time, drawing batches from seeded epoch permutations."""

    def __init__(self, model: Any, data: torch.Tensor, args: argparse.Namespace) -> None:
        self.model = model
        self.data = data
        self.args = args
        self.opt = make_optimizer(model, args)
        self.g = torch.Generator().manual_seed(args.seed)
        self.order: list[int] = []

    def next_batch(self) -> torch.Tensor:
        batch = self.args.batch
        if len(self.order) < batch:
            self.order = self.order + torch.randperm(len(self.data), generator=self.g).tolist()
        idx, self.order = self.order[:batch], self.order[batch:]
        return self.data[idx]

    def lr(self, step: int, total: int) -> float:
        return lr_at(step, total, self.args.warmup, self.args.lr, 0.1)

    def step(self, step: int, total: int) -> float:
        lr = self.lr(step, total)
        for grp in self.opt.param_groups:
            grp["lr"] = lr
        batch = self.next_batch()
        loss = self.model(input_ids=batch, labels=batch).loss
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.item()


def timing_probe(run: Run, trainer: Trainer, t_train0: float, curve: list[dict]) -> tuple[int, int]:
    """Run the first steps for real (warmup schedule for a provisional total) and fix the
    total from the measured speed.  Returns (steps done, total steps)."""
    probe_steps = 8
    provisional = 10_000
    losses = []
    for step in range(probe_steps):
        losses.append(trainer.step(step, provisional))
    per_step = (time.time() - t_train0) / probe_steps
    budget_s = run.args.max_minutes * 60
    total_steps = max(probe_steps + 1, int(budget_s * 0.93 / per_step))
    run.say(
        f"timing probe: {per_step:.2f} s/step -> {total_steps} steps "
        f"(re-run with --steps {total_steps} to reproduce)"
    )
    curve.append(
        {
            "step": probe_steps,
            "loss": sum(losses) / len(losses),
            "lr": trainer.lr(probe_steps - 1, total_steps),
            "elapsed_s": round(time.time() - t_train0, 1),
        }
    )
    # Note: the probe steps used a warmup computed for the provisional total, which is
    # identical (warmup only depends on the step index) as long as total > warmup.
    return probe_steps, total_steps


def train_loop(
    run: Run, trainer: Trainer, step: int, total_steps: int, t_train0: float, curve: list[dict]
) -> tuple[int, bool]:
    """Train from ``step`` to ``total_steps``, logging every --log-every steps; stops early
    past 115% of --max-minutes.  Returns (steps done, stopped early)."""
    args = run.args
    budget_s = args.max_minutes * 60
    acc = 0.0
    acc_n = 0
    while step < total_steps:
        acc += trainer.step(step, total_steps)
        acc_n += 1
        step += 1
        if step % args.log_every == 0 or step == total_steps:
            elapsed = time.time() - t_train0
            rec = {
                "step": step,
                "loss": round(acc / acc_n, 4),
                "lr": round(trainer.lr(step - 1, total_steps), 6),
                "elapsed_s": round(elapsed, 1),
            }
            curve.append(rec)
            eta = elapsed / step * (total_steps - step)
            run.say(
                f"step {step:5d}/{total_steps}  loss {rec['loss']:.4f}  lr {rec['lr']:.2e}  "
                f"eta {eta / 60:.1f} min"
            )
            acc, acc_n = 0.0, 0
        if time.time() - t_train0 > budget_s * 1.15 and step < total_steps:
            run.say(f"!! over the time budget, stopping at step {step}")
            return step, True
    return step, False


def train(run: Run, tokens: Tokens) -> Training:
    """Build the model and train it, for --steps or for what the timing probe chose."""
    model = make_model(run.args, tokens.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    run.say(f"model: {n_params:,} parameters")
    trainer = Trainer(model, tokens.data, run.args)
    model.train()
    t_train0 = time.time()
    curve: list[dict] = []
    if run.args.steps is None:
        step, total_steps = timing_probe(run, trainer, t_train0, curve)
    else:
        step, total_steps = 0, run.args.steps
    step, stopped_early = train_loop(run, trainer, step, total_steps, t_train0, curve)
    train_s = time.time() - t_train0
    return Training(model, n_params, step, total_steps, stopped_early, curve, train_s)


def evaluate(run: Run, model: Any, held: Heldout) -> Evaluation:
    """Held-out perplexity of the trained model (see heldout_perplexity)."""
    ev = Evaluation(*heldout_perplexity(model, held.ids, HELDOUT_WINDOWS))
    run.say(
        f"held-out perplexity {ev.ppl:.3f} (mean NLL {ev.mean_nll:.4f} nats over {ev.n_eval} "
        "tokens)"
    )
    return ev


def save_model(run: Run, model: Any, tokens: Tokens) -> None:
    """Write the Hugging Face model directory (weights, tokenizer, generation config)."""
    from transformers import GenerationConfig

    model.config.use_cache = True
    model.save_pretrained(run.out, safe_serialization=True)
    tokens.hf_tok.save_pretrained(run.out)
    gen = GenerationConfig(
        bos_token_id=tokens.eot_id,
        eos_token_id=[tokens.im_end_id, tokens.eot_id],
        pad_token_id=tokens.eot_id,
        do_sample=False,
        max_new_tokens=64,
    )
    gen.save_pretrained(run.out)
    add_compat_fields(run.out)


def reload_saved(run: Run, held: Heldout, ev: Evaluation) -> tuple[Any, Any]:
    """Reload the directory from disk (offline) and check it reproduces the perplexity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(run.out)
    model2 = AutoModelForCausalLM.from_pretrained(run.out)
    model2.eval()
    ppl2, _, _, _ = heldout_perplexity(
        model2, tok2(held.text, verbose=False)["input_ids"], HELDOUT_WINDOWS
    )
    assert abs(ppl2 - ev.ppl) < 1e-3 * ev.ppl, (ev.ppl, ppl2)
    return tok2, model2


@torch.no_grad()
def greedy(tok: Any, model: Any, prompt: str, max_new_tokens: int) -> str:
    """The greedy completion of ``prompt`` (without the prompt)."""
    ids = tok(prompt, return_tensors="pt")
    o = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(o[0, ids["input_ids"].shape[1] :])


def make_samples(run: Run, tok: Any, model: Any) -> list[dict]:
    """Greedy completions of SAMPLE_PROMPTS and of one ChatML exchange, for the card."""
    samples = [{"prompt": p, "completion": greedy(tok, model, p, 40)} for p in SAMPLE_PROMPTS]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": CHAT_SAMPLE}],
        add_generation_prompt=True,
        tokenize=False,
    )
    samples.append({"prompt": chat, "chat": True, "completion": greedy(tok, model, chat, 60)})
    for s in samples:
        run.say(f"sample {s['prompt']!r} -> {s['completion']!r}")
    return samples



# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    run = start_run(argv)
    corpus = load_corpus(run)
    tokens = tokenize_corpus(run, corpus)
    held = write_heldout(run, corpus, tokens)
    tr = train(run, tokens)
    ev = evaluate(run, tr.model, held)
    save_model(run, tr.model, tokens)
    tok2, model2 = reload_saved(run, held, ev)
    samples = make_samples(run, tok2, model2)
    files = {p.name: p.stat().st_size for p in sorted(run.out.iterdir()) if p.is_file()}
    wall = time.time() - run.t_start
    log = build_log(run, corpus, tokens, held, tr, ev, samples, files, wall)
    log_text = json.dumps(log, indent=2, ensure_ascii=False) + "\n"
    (run.out / "training_log.json").write_text(log_text)
    write_card(run.out, log, HELDOUT_EVERY, CHAT_SAMPLE)
    run.say(f"done in {wall / 60:.1f} min; weights {log['weights_bytes'] / 1e6:.2f} MB")
    return 0



if __name__ == "__main__":
    sys.exit(main())
