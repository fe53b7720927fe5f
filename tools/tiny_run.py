"""The tiny model's training run: its constants and the state its phases hand each other
(`train_tiny_model.py` runs the phases, `tiny_log.py` writes what they found)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tiny_corpus import IM_END, IM_START

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


@dataclass
class Run:
    """What every phase needs: the parsed arguments, the output directory, the clock."""

    args: argparse.Namespace
    argv: list[str] | None
    out: Path
    t_start: float
    defaults: dict  # the parser's defaults (reproduce_with)

    def say(self, msg: str) -> None:
        print(f"[{time.time() - self.t_start:7.1f}s] {msg}", flush=True)


@dataclass
class Corpus:
    meta: dict
    train_docs: list[dict]
    held_docs: list[dict]
    train_texts: list[str]
    n_chat: int


@dataclass
class Tokens:
    tok: Any  # tokenizers.Tokenizer
    hf_tok: Any  # transformers.PreTrainedTokenizerFast
    vocab_size: int
    eot_id: int
    im_start_id: int
    im_end_id: int
    stream: list[int]
    data: torch.Tensor  # (n_chunks, SEQ_LEN)
    chars_per_tok: float

    @property
    def n_chunks(self) -> int:
        return self.data.shape[0]


@dataclass
class Heldout:
    text: str
    ids: list[int]
    raw: bytes


@dataclass
class Training:
    model: Any  # transformers.LlamaForCausalLM
    n_params: int
    steps: int
    total_steps: int
    stopped_early: bool
    curve: list[dict]
    train_s: float


@dataclass
class Evaluation:
    ppl: float
    mean_nll: float
    n_eval: int
    window_nll: list[float]
