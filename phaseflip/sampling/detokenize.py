"""Incremental detokenisation and stop-string search.

Decoding token by token and concatenating is wrong for tokenizers whose text depends on context
(SentencePiece drops the leading space of the first token it decodes; byte-level BPE can split
one UTF-8 character over several tokens). We decode a short window instead: `prefix_offset`
marks a few already-emitted tokens kept as context and `read_offset` the first token whose text
was not emitted yet; the delta is decode(window) minus decode(context). With a stock fast
tokenizer, `tokenizers.decoders.DecodeStream` runs that same algorithm in Rust (one call a token
instead of two decodes and the Python around them: ~0.7 against ~2.2 us a token), and the window
path takes over for good if it refuses a token.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context when `context_from_prompt` is set (enough for any tokenizer's
# context effects, cheap to re-decode).
_PROMPT_CONTEXT = 5
# How many of the text's last characters `partial_stop_len` looks for in a stop string at once.
_STOP_TAIL = 16
# Failed candidates `partial_stop_len` tries per stop string before it runs KMP instead.
_STOP_TRIES = 8


class Decoder(Protocol):
    """The part of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def direct_decode(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The Rust `tokenizers.Tokenizer.decode` behind a stock Hugging Face fast tokenizer, when
    calling it returns exactly what `tokenizer.decode(ids, skip_special_tokens=...)` does: no
    clean-up pass and neither `decode` nor `_decode` overridden. None otherwise.

    Why: the detokenizer decodes twice per token per request (512 calls a step at a full
    batch), and transformers' Python wrapper around the Rust call costs ~2.5 us of the ~3.6.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    # A tokenizer with a Rust backend was made by these libraries, so they are imported already.
    transformers, tokenizers = sys.modules.get("transformers"), sys.modules.get("tokenizers")
    if transformers is None or tokenizers is None or not isinstance(backend, tokenizers.Tokenizer):
        return None
    base = getattr(transformers, "PreTrainedTokenizerBase", None)
    stock = {getattr(getattr(transformers, name, None), "_decode", None)
             for name in ("PreTrainedTokenizerFast", "TokenizersBackend")} - {None}
    cls = type(tokenizer)
    if base is None or getattr(cls, "decode", None) is not base.decode or (
        getattr(cls, "_decode", None) not in stock
    ):
        return None
    return backend.decode


def decode_stream(skip_special_tokens: bool) -> Any | None:
    """A fresh `tokenizers.decoders.DecodeStream`, or None where this `tokenizers` lacks it
    (before 0.21)."""
    decoders = getattr(sys.modules.get("tokenizers"), "decoders", None)
    cls = getattr(decoders, "DecodeStream", None)
    return None if cls is None else cls(skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text without re-decoding everything each
    step and without emitting half a UTF-8 character: text ending in U+FFFD is held back until
    a later token completes it (or `flush` gives up on it at the end).

    By default the text equals `tokenizer.decode(output_ids, skip_special_tokens=...)`. With
    `context_from_prompt=True` the last prompt tokens are used as decoding context instead, so
    a SentencePiece first token keeps its leading space (prompt text + output text reads right).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: list[int],
        skip_special_tokens: bool = True,
        *,
        context_from_prompt: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._direct = direct_decode(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-_PROMPT_CONTEXT:]) if context_from_prompt else []
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        # decode(ids[prefix_offset:read_offset]) while the offsets stay put (held-back tokens)
        self._prefix_text: str | None = None
        self._text = ""
        # the Rust twin of `_append_window` (same offsets, same text); prompt context would
        # need its prefill, which the window path does as cheaply once per request
        self._stream = decode_stream(skip_special_tokens) if (
            self._direct is not None and not context) else None
        self._backend = getattr(tokenizer, "_tokenizer", None)  # what the stream decodes with

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._direct is not None:
            return self._direct(ids, self._skip_special_tokens)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def append(self, token_ids: list[int]) -> str:
        """Add newly generated tokens; return the text that became stable (possibly "")."""
        if self._stream is None:
            return self._append_window(token_ids)
        out = ""
        for i, tok in enumerate(token_ids):
            try:
                chunk = self._stream.step(self._backend, tok)
            except Exception:  # its prefix check (a window's text rewrote the context's)
                self._stream = None
                return out + self._append_window(token_ids[i:])
            self._ids.append(tok)
            if chunk is not None:
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                self._append(chunk)
                out += chunk
        return out

    def _append_window(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            self._prefix_text = prefix_text
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet (e.g. a skipped special token) or a character is incomplete.
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        self._append(delta)
        return delta

    def flush(self) -> str:
        """Emit held-back text (a trailing U+FFFD that no token completed); call at the end."""
        self._stream = None  # its state would be stale past these offsets
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        if len(new_text) <= len(prefix_text):
            return ""
        delta = new_text[len(prefix_text) :]
        self._append(delta)
        return delta

    def _append(self, delta: str) -> None:
        """`_text += delta` in amortised O(len(delta)): CPython grows a str in place only when
        a local name holds its one reference (an attribute's `+=` copies the whole text, which
        made a long output's appends quadratic: 800 000 characters in 4-character deltas
        took seconds)."""
        text, self._text = self._text, ""
        text += delta
        self._text = text

    @property
    def text(self) -> str:
        """All stable output text so far."""
        return self._text

    @property
    def output_ids(self) -> list[int]:
        """The output token ids appended so far (prompt context excluded)."""
        return self._ids[self._num_context :]


def find_stop_match(text: str, stop: list[str], start: int) -> tuple[int, str] | None:
    """(index, stop string) of the earliest match whose last character is at or after `start`;
    at equal index the shorter string wins, as a token-by-token stream would have seen it first.
    """
    best: tuple[int, str] | None = None
    for s in stop:
        if not s:
            continue
        idx = text.find(s, max(0, start - len(s) + 1))
        if idx < 0:
            continue
        if best is None or idx < best[0] or (idx == best[0] and len(s) < len(best[1])):
            best = (idx, s)
    return best


def partial_stop_len(text: str, stop: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string: text a
    stream holds back, since the next token may turn it into a stop match (the engine's
    rule, `OutputProcessor.delta`).

    Runs every step for every request with stop strings, so it only tries the n where
    s[:n] can end the text, found by `rfind`, longest first (trying every n, slicing s[:n]
    each time, took O(len(s)^2): 10 ms a step for 16 stop strings of 1024 characters). A
    periodic stop string makes every n such a candidate (`"c" + "a" * 1023` against an output
    forced to "a"s: 10 ms again), so past `_STOP_TRIES` failed ones KMP answers in O(len(s))."""
    if not text:
        return 0
    tail = text[-_STOP_TAIL:]
    last, k, longest = text[-1], len(tail), 0
    for s in stop:
        hi = min(len(s) - 1, len(text))  # the longest n to try
        if hi <= longest:
            continue
        # n >= k: s[n-k:n] is the text's last k characters
        p = s.rfind(tail, 0, hi)
        tries = _STOP_TRIES
        while p >= 0 and p + k > longest:
            if not tries:  # a periodic s: up to len(s) candidates could follow
                n = _kmp_suffix(text, s, k, p + k)
                if n >= 0:
                    longest = max(longest, n)
                    break
                p = -1  # no n >= k: on to n < k
            elif text.endswith(s[: p + k]):
                longest = p + k
                break
            else:
                tries -= 1
                p = s.rfind(tail, 0, p + k - 1)
        else:  # n < k: s[n-1] is the text's last character
            i = s.rfind(last, 0, min(hi, k - 1))
            while i >= longest:  # n = i + 1 > longest
                if text.endswith(s[: i + 1]):
                    longest = i + 1
                    break
                i = s.rfind(last, 0, i)
    return longest


def _kmp_suffix(text: str, s: str, k: int, bound: int) -> int:
    """The longest n < len(s) such that `text` ends with s[:n], in O(bound), given that none
    in [k, len(s)) is above `bound`; -1 where none is >= k.

    Such an n >= k starts with s[:k], so its suffix lies in text[start:] (the first s[:k]
    within the last `bound` characters), as does every n < k: len(text) - start >= k."""
    start = text.find(s[:k], len(text) - bound)
    if start < 0:
        return -1
    b = _kmp_borders(s)
    q = k  # KMP's state after text[start : start + k]
    for c in text[start + k :]:
        while s[q] != c:
            if not q:
                break
            q = b[q]
        else:
            q += 1
    return q


@lru_cache(maxsize=64)
def _kmp_borders(s: str) -> tuple[int, ...]:
    """b[q]: length of the longest proper border of s[:q] (KMP's failure function), kept per
    stop string since `_kmp_suffix` may need it every step of a request."""
    b = [0] * (len(s) + 1)
    q = 0
    for j in range(1, len(s)):
        c = s[j]
        while q and s[q] != c:
            q = b[q]
        if s[q] == c:
            q += 1
        b[j + 1] = q
    return tuple(b)
