"""Edges found by the soak audit: the held-back stop-string suffix (`partial_stop_len`) made
cheap with the same answers, and per-request state that must not outlive its request."""

from __future__ import annotations

import random
import time

import pytest

from phaseflip.sampling import detokenize
from phaseflip.sampling.detokenize import partial_stop_len


def reference_partial_stop_len(text: str, stop: list[str]) -> int:
    """The function as it was before (every n tried, O(len(s)^2)): the oracle."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


# small alphabets make overlapping prefixes and periodic strings common; combining marks,
# astral characters and U+FFFD are single code points like any other
ALPHABETS = ["ab", "abc", "a b\n", "aé😀\u0301\ufffd", "xyzXYZ0123 .,"]


def _word(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def _case(rng: random.Random) -> tuple[str, list[str]]:
    alphabet = rng.choice(ALPHABETS)
    stop = []
    for _ in range(rng.randint(0, 5)):
        kind = rng.random()
        if kind < 0.15:  # periodic: every shift is a candidate
            unit = _word(rng, alphabet, rng.randint(1, 3))
            s = (unit * 80)[: rng.randint(1, 80)]
        else:
            s = _word(rng, alphabet, rng.choice([0, 1, 2, 3, 5, 15, 16, 17, 33, 70]))
        stop.append(s)
    text = _word(rng, alphabet, rng.choice([0, 1, 2, 5, 15, 16, 17, 40, 100]))
    if stop and rng.random() < 0.6:  # end the text with a prefix of a stop string
        s = rng.choice(stop)
        text += s[: rng.randint(0, len(s))]
    if stop and rng.random() < 0.2:  # ... or with a whole one
        text += rng.choice(stop)
    return text, stop


def test_partial_stop_len_equals_the_old_one_on_random_cases():
    rng = random.Random(1234)
    for i in range(30_000):
        text, stop = _case(rng)
        assert partial_stop_len(text, stop) == reference_partial_stop_len(text, stop), (
            i, text, stop)


@pytest.mark.parametrize("text, stop, want", [
    ("", ["abc"], 0),
    ("x", [""], 0),
    ("ab", ["abc"], 2),
    ("abc", ["abc"], 0),  # a whole stop string is no proper prefix
    ("aaaa", ["aaaaa"], 4),
    ("abab", ["ababx"], 4),
    ("xaba", ["ababx"], 3),
    ("é😀", ["😀é", "é😀!"], 2),
    ("q" + "a" * 30, ["a" * 40], 30),  # longer than the 16-character tail
    ("b" * 50, ["ab" * 40], 0),
])
def test_partial_stop_len_cases(text, stop, want):
    assert partial_stop_len(text, stop) == want == reference_partial_stop_len(text, stop)


def test_partial_stop_len_is_cheap_with_long_stop_strings():
    """16 stop strings of 1024 characters: the old function took ~10 ms a call here."""
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz ,.\n"
    stop = [_word(rng, alphabet, 1024) for _ in range(16)]
    texts = [_word(rng, alphabet, 4000), _word(rng, alphabet, 4000) + stop[3][:700],
             "b" * 4000]
    for text in texts:
        assert partial_stop_len(text, stop) == reference_partial_stop_len(text, stop)
    t0 = time.perf_counter()
    for _ in range(20):
        for text in texts:
            partial_stop_len(text, stop)
    per_call_s = (time.perf_counter() - t0) / 60
    assert per_call_s < 2e-3, f"{per_call_s * 1e6:.0f} us a call"


def _repetitive(rng: random.Random, n: int, unit: str = "") -> str:
    """An 'a'/'b' string made of a short unit repeated, with a few characters flipped: many
    shifts of a stop string match the text's tail, which sends `partial_stop_len` to KMP."""
    unit = unit or _word(rng, "ab", rng.randint(1, 4))
    chars = list((unit * (n // len(unit) + 1))[:n])
    for _ in range(rng.randint(0, 3) if n else 0):
        i = rng.randrange(n)
        chars[i] = "b" if chars[i] == "a" else "a"
    return "".join(chars)


def test_partial_stop_len_equals_the_old_one_on_repetitive_cases(monkeypatch):
    calls = 0
    kmp_suffix = detokenize._kmp_suffix

    def counted(*args: object) -> int:
        nonlocal calls
        calls += 1
        return kmp_suffix(*args)

    monkeypatch.setattr(detokenize, "_kmp_suffix", counted)
    rng = random.Random(99)
    for i in range(5_000):
        unit = _word(rng, "ab", rng.randint(1, 4))
        stop = [_repetitive(rng, rng.choice([1, 2, 17, 40, 100, 300]), unit)
                for _ in range(rng.randint(1, 4))]
        text = _repetitive(rng, rng.choice([0, 1, 16, 30, 100, 400]), unit)
        if rng.random() < 0.5:
            s = rng.choice(stop)
            text += s[: rng.randint(0, len(s))]
        assert partial_stop_len(text, stop) == reference_partial_stop_len(text, stop), (
            i, text, stop)
    assert calls > 500, calls  # the fallback ran often (~950 times)


def test_partial_stop_len_kmp_fallback_alone_equals_the_old_one(monkeypatch):
    """No candidate tried before KMP: the fallback answers every random case by itself."""
    monkeypatch.setattr(detokenize, "_STOP_TRIES", 0)
    rng = random.Random(4321)
    for i in range(20_000):
        text, stop = _case(rng) if i % 2 else (_repetitive(rng, rng.randint(0, 60)),
                                                [_repetitive(rng, rng.randint(0, 60))])
        assert partial_stop_len(text, stop) == reference_partial_stop_len(text, stop), (
            i, text, stop)


@pytest.mark.parametrize("stop", [
    # every shift is a candidate and none ends the text (which lacks their first character):
    # ~10 ms a call with candidates tried until they ran out
    [chr(ord("A") + i) + "a" * 1023 for i in range(16)],
    # the same, but the stop strings' heads are in the text: KMP runs over ~1000 characters
    ["a" * 16 + chr(ord("A") + i) + "a" * 1007 for i in range(16)],
], ids=["crafted", "kmp"])
def test_partial_stop_len_is_linear_on_crafted_stop_strings(stop):
    """An output forced to "a"s (logit_bias) against periodic stop strings of the maximum size."""
    text = "a" * 2000
    assert partial_stop_len(text, stop) == reference_partial_stop_len(text, stop)
    per_call_s = min(_time_per_call(text, stop, 5) for _ in range(3))
    assert per_call_s < 5e-3, f"{per_call_s * 1e6:.0f} us a call"


def _time_per_call(text: str, stop: list[str], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        partial_stop_len(text, stop)
    return (time.perf_counter() - t0) / calls
