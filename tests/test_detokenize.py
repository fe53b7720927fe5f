from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from phaseflip.sampling.detokenize import (
    IncrementalDetokenizer,
    find_stop_match,
    partial_stop_len,
)

FFFD = "\ufffd"
CORPUS = (
    "héllo wörld 日本語 🙂 the quick brown fox jumps over the lazy dog. "
    "Größe straße café naïve façade — ünïcödé 東京 こんにちは 👍🏽 ok! "
) * 8


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _metaspace() -> PreTrainedTokenizerFast:
    """SentencePiece-style: decode() drops the leading space of the first token only."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<eos>"], show_progress=False
    )
    tok.train_from_iterator([CORPUS], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizers_by_kind() -> dict[str, PreTrainedTokenizerFast]:
    return {"byte_level": _byte_level(), "metaspace": _metaspace()}


class RefusingStream:
    """A DecodeStream that refuses its `after`-th token (as the real one does when a window's
    text does not start with its context's)."""

    def __init__(self, stream, after: int) -> None:
        self.stream, self.left = stream, after

    def step(self, tokenizer, tok):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("Invalid prefix encountered")
        return self.stream.step(tokenizer, tok)


def _with_path(detok: IncrementalDetokenizer, path: str, rng: random.Random) -> None:
    if path == "stream":
        assert detok._stream is not None  # a stock fast tokenizer takes the Rust path
    elif path == "window":
        detok._stream = None
    else:
        detok._stream = RefusingStream(detok._stream, rng.randint(0, 10))


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("path", ["stream", "window", "refused"])
def test_incremental_equals_full_decode(
    tokenizers_by_kind: dict[str, PreTrainedTokenizerFast], kind: str, skip_special: bool,
    path: str,
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    vocab = len(tokenizer)
    held_back = 0
    for seed in range(60):
        rng = random.Random(seed)
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special)
        _with_path(detok, path, rng)
        pos = 0
        while pos < len(ids):
            chunk = ids[pos : pos + rng.randint(1, 3)]
            pos += len(chunk)
            before = detok.text
            delta = detok.append(chunk)
            assert detok.text == before + delta
            so_far = tokenizer.decode(ids[:pos], skip_special_tokens=skip_special)
            assert so_far.startswith(detok.text), (seed, ids[:pos])
            held_back += len(so_far) > len(detok.text)
        full = tokenizer.decode(ids, skip_special_tokens=skip_special)
        if not full.endswith(FFFD):
            assert detok.text == full, (seed, ids)
        detok.flush()
        assert detok.text == full, (seed, ids)
        assert detok.output_ids == ids
    if kind == "byte_level":  # split UTF-8 characters really exercised the hold-back path
        assert held_back > 0


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_multibyte_characters_never_emit_replacement_char(
    tokenizers_by_kind: dict[str, PreTrainedTokenizerFast], kind: str
) -> None:
    tokenizer = tokenizers_by_kind[kind]
    text = "héllo 日本語 🙂 wörld 👍🏽 東京 café"
    ids = tokenizer.encode(text)
    if kind == "byte_level":  # some character must really be split over several tokens
        assert any(FFFD in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=[])
    deltas = [detok.append([i]) for i in ids]
    assert all(FFFD not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == detok.text
    if kind == "byte_level":
        assert "" in deltas  # held back at least once


def test_prompt_context_keeps_sentencepiece_leading_space(
    tokenizers_by_kind: dict[str, PreTrainedTokenizerFast],
) -> None:
    tokenizer = tokenizers_by_kind["metaspace"]
    prompt = tokenizer.encode("the quick")
    out = tokenizer.encode(" brown fox")[-2:]  # "▁brown", "▁fox" (or finer pieces)
    plain = IncrementalDetokenizer(tokenizer, prompt)
    contextual = IncrementalDetokenizer(tokenizer, prompt, context_from_prompt=True)
    for tok in out:
        plain.append([tok])
        contextual.append([tok])
    assert plain.text == tokenizer.decode(out)
    assert not plain.text.startswith(" ")
    assert contextual.text == " " + plain.text


def test_skip_special_tokens_flag(tokenizers_by_kind: dict[str, PreTrainedTokenizerFast]) -> None:
    tokenizer = tokenizers_by_kind["byte_level"]
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = [*tokenizer.encode("ok"), eos, *tokenizer.encode(" fox")]
    skipping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    keeping = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    for i in ids:
        skipping.append([i])
        keeping.append([i])
    assert skipping.text == "ok fox"
    assert keeping.text == "ok<eos> fox"


def find_stop(text: str, stop: list[str], start: int) -> int | None:
    match = find_stop_match(text, stop, start)
    return None if match is None else match[0]


def test_find_stop_straddling_deltas() -> None:
    stop = ["STOP", "never"]
    longest = max(len(s) for s in stop)
    text = ""
    found: list[int | None] = []
    for delta in ["Hello wo", "rld ST", "OP and more"]:
        before = len(text)
        text += delta
        found.append(find_stop(text, stop, max(0, before - longest + 1)))
    assert found == [None, None, len("Hello world ")]
    # Passing just the previous length also works: the match ends in the new delta.
    assert find_stop(text, stop, len("Hello world ST")) == len("Hello world ")


def test_find_stop_earliest_and_start_window() -> None:
    text = "abc END xyz STOP"
    assert find_stop(text, ["STOP", "END"], 0) == 4
    assert find_stop(text, ["STOP", "END"], 7) == 12  # END ends at 6, before start
    assert find_stop(text, ["STOP", "END"], 6) == 4  # END's last char is at 6
    assert find_stop(text, ["nope"], 0) is None
    assert find_stop("xxSTOP", ["STOP"], 5) == 2
    assert find_stop("xxSTOP", ["STOP"], 6) is None
    assert find_stop_match("say abc", ["abc", "ab", "b"], 0) == (4, "ab")


def test_partial_stop_len() -> None:
    assert partial_stop_len("hello ST", ["STOP"]) == 2
    assert partial_stop_len("hello STOP", ["STOP"]) == 0  # a full match is find_stop_match's
    assert partial_stop_len("hello", ["STOP", "o w"]) == 1
    assert partial_stop_len("", ["STOP"]) == 0
