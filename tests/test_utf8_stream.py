"""Constrained answers stay valid UTF-8, so the text the client assembles has the length the
grammar counted (issue 20: a `maxLength` 12 string reached the client 14 characters long).

xgrammar read the UTF-8 form of a surrogate (ED A0-BF xx, U+D800-U+DFFF) as one character of a
string; every decoder turns those three bytes into three U+FFFD. The grammar layer takes
surrogates out of every character class and pattern (`sampling/surrogates.py`); the
streaming detokenizer already joins to `tokenizer.decode` of all the ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import phaseflip
from benchmarks import schema_check
from phaseflip import SamplingParams
from phaseflip.sampling.detokenize import IncrementalDetokenizer
from phaseflip.sampling.grammar import GrammarBook, GrammarSpec, _build
from phaseflip.sampling.surrogates import regex_without_surrogates, without_surrogates
from phaseflip.scheduler.request import Req

EMBEDDED = Path(phaseflip.__file__).parent / "assets" / "tiny-llama"
NESTED = Path(__file__).parent.parent / "benchmarks" / "schemas" / "nested.json"
VOCAB = 4096
SURROGATES = (b"\xed\xa0\x80", b"\xed\xa4\x8d", b"\xed\xbf\xbf")  # U+D800, U+D90D, U+DFFF
NEIGHBOURS = ("\ud7ff", "\ue000", "\ufffd", "中", "😀", "\x81")  # valid, around them


def _accepts(grammar, data: bytes) -> bool:
    from xgrammar.testing import _get_matcher_from_grammar

    matcher = _get_matcher_from_grammar(grammar)
    return matcher.accept_string(data) and matcher.is_terminated()


@pytest.mark.parametrize(("spec", "wrap"), [
    (GrammarSpec.json_schema({"type": "string", "maxLength": 5}), b'"%s"'),
    (GrammarSpec.json_schema({"type": "string"}), b'"%s"'),
    (GrammarSpec("json_object"), b'{"%s": 1}'),
    (GrammarSpec.json_schema({"type": "string", "pattern": "^.{0,3}$"}), b'"%s"'),
    (GrammarSpec.json_schema({"type": "string", "pattern": r"^[a\s\S]{0,3}$"}), b'"%s"'),
    (GrammarSpec.json_schema({"type": "string", "pattern": r"^\W?[^a]{0,3}$"}), b'"%s"'),
    (GrammarSpec("regex", ".{0,3}"), b"%s"),
    (GrammarSpec("regex", r"\S{0,3}"), b"%s"),
    (GrammarSpec("ebnf", r"root ::= [\u0080-\U0010ffff]*"), b"%s"),
], ids=["maxLength", "string", "json_object", "pattern_dot", "pattern_class_S",
     "pattern_W_negated", "regex_dot", "regex_nonspace", "ebnf_range"])
def test_grammars_refuse_surrogates_and_keep_their_neighbours(spec, wrap) -> None:
    """Red without `without_surrogates`: xgrammar accepts all three surrogates in each."""
    grammar = _build(spec)
    for bad in SURROGATES:
        assert not _accepts(grammar, wrap % bad), (spec, bad)
    for good in NEIGHBOURS:
        assert _accepts(grammar, wrap % good.encode()), (spec, good)


def test_class_rewrite_leaves_literals_and_splits_ranges() -> None:
    text = (r'r ::= (("[^a]\"[" [^a] [\0-\U0010ffff] [a-z] [\-\]] [^\0-\U0010ffff] '
            r'Regex("^a.\\S[\\s\\S]\\.\"$", json_string=true)))')
    fixed = without_surrogates(text)
    assert fixed == (r'r ::= (("[^a]\"[" [^a\ud800-\udfff] [\x00-\ud7ff\ue000-\U0010ffff] '
                     r'[a-z] [\-\]] [^\0-\U0010ffff] '
                     r'Regex("^a[^\\ud800-\\udfff][^\\s\\ud800-\\udfff]'
                     r'([\\s]|[^\\s\\ud800-\\udfff])\\.\"$", json_string=true)))')
    assert without_surrogates(fixed) == fixed


def test_regex_rewrite() -> None:
    assert regex_without_surrogates(r"\.a\d\w+") == r"\.a\d\w+"  # nothing to take out
    assert regex_without_surrogates(r"[^\]x]") == r"[^\]x\ud800-\udfff]"
    assert regex_without_surrogates("[\u0080-\U0010ffff]") == r"[\x80-\ud7ff\ue000-\U0010ffff]"
    assert regex_without_surrogates(r"\D{2}") == r"[^\d\ud800-\udfff]{2}"


@pytest.fixture(scope="module")
def nested_book():
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED)
    spec = GrammarSpec.json_schema(NESTED.read_text())
    book = GrammarBook(tokenizer, VOCAB)
    book.compiled(spec)
    yield tokenizer, book, spec
    book.close()


def _byte_tokens(tokenizer) -> dict[int, int]:
    """Byte value → the id of the byte-level token of that one byte (GPT-2's byte alphabet)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    shifted = {b: chr(b) for b in printable}
    shifted |= {b: chr(256 + i) for i, b in enumerate(sorted(set(range(256)) - set(printable)))}
    return {b: tokenizer.convert_tokens_to_ids(c) for b, c in shifted.items()}


def _walk(tokenizer, book, spec, rng: random.Random, byte_ids: list[int]) -> tuple[list, str]:
    """A random model's answer: each step a random token the mask allows, half the time a
    single non-ASCII byte when one is allowed (so characters split over tokens, and
    surrogates if the grammar let them, are common). Returns (ids, streamed text)."""
    req = Req(rid="w", prompt_ids=[1], params=SamplingParams(grammar=spec), eos_ids=(0,),
              arrival=0, output_ids=[])
    assert book.register(req)
    detok = IncrementalDetokenizer(tokenizer, [1])
    streamed = ""
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(384):
        _, bitmask = book.masks([req])
        allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).view(-1)[:VOCAB].nonzero()
        allowed = allowed.view(-1).tolist()
        pool = [t for t in byte_ids if t in set(allowed)] if rng.random() < 0.5 else []
        tok = rng.choice(pool or allowed)
        if tok == 0:
            break
        req.output_ids.append(tok)
        streamed += detok.append([tok])
    return req.output_ids, streamed + detok.flush()


def test_random_answers_to_the_nested_schema_validate_as_streamed(nested_book) -> None:
    """Random tokens the nested schema's mask allows, streamed through the detokenizer: the
    streamed text is `decode(ids)` and validates (red without the fix: surrogates in
    `maxLength` strings)."""
    tokenizer, book, spec = nested_book
    schema = json.loads(spec.value)
    byte_ids = [i for b, i in _byte_tokens(tokenizer).items() if b >= 0x80]
    rng = random.Random(0)
    for n in range(12):
        ids, streamed = _walk(tokenizer, book, spec, rng, byte_ids)
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True), n
        assert "\ufffd" not in streamed, (n, streamed)
        assert schema_check.problems(json.loads(streamed), schema) == [], (n, streamed)


def test_a_surrogate_lead_byte_allows_no_surrogate_continuation(nested_book) -> None:
    """Inside a `maxLength` string, after the byte ED the mask allows 80-9F (U+D000-U+D7FF)
    and none of A0-BF (U+D800-U+DFFF)."""
    tokenizer, book, spec = nested_book
    byte = _byte_tokens(tokenizer)
    prefix = tokenizer.encode('{"thought": "', add_special_tokens=False) + [byte[0xED]]
    req = Req(rid="s", prompt_ids=[1], params=SamplingParams(grammar=spec), eos_ids=(0,),
              arrival=0, output_ids=prefix)
    assert book.register(req)
    _, bitmask = book.masks([req])
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = set(((bitmask[0].unsqueeze(-1) >> shifts) & 1).view(-1)[:VOCAB].nonzero()
                  .view(-1).tolist())
    assert {byte[b] for b in range(0x80, 0xA0)} <= allowed
    assert not {byte[b] for b in range(0xA0, 0xC0)} & allowed
