"""What each token contributes to the text, for the logprobs of completions and chat.

A byte-level tokenizer can split one UTF-8 character over several tokens. Decoding such a token
alone gives U+FFFD, and counting that as one character made `text_offset` drift past the end of
the text. Here a token is spelt by its bytes: as text when they are whole characters, otherwise
as `bytes:\\xe2\\x80` (the form OpenAI and vLLM use), and offsets come from decoding the bytes
in order, so `text_offset[i]` is the index in the returned text of the character where token i
begins (for a token inside a character, that character's index).

A token the text leaves out (a special token with `skip_special_tokens`; the end-of-text or
stop token that ended generation, unless `include_stop_str_in_output`) is spelt `""` at offset
`len(text so far)`, so `"".join(tokens)` is the text whenever every token is whole characters.
Its logprob is still reported.
"""

from __future__ import annotations

import codecs
import re
from collections import Counter
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for the 256 bytes), char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def spell_bytes(data: bytes) -> str:
    """A token's string: its text when `data` is whole UTF-8 characters, else `bytes:\\xNN..`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TokenText:
    """Per tokenizer: each token's bytes and spelling, and which tokens are special."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.added = set(added)
        self.special = set(getattr(tokenizer, "all_special_ids", [])) | {
            i for i, t in added.items() if getattr(t, "special", False)}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        data = self._bytes.get(token_id)
        if data is None:
            data = self._bytes[token_id] = self._find_bytes(token_id)
        return data

    def _find_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self.added:
            return piece.encode()
        alphabet = _byte_level_alphabet()
        if self.byte_level and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.tokenizer.decode([token_id]).encode()  # SentencePiece and the rest

    def spell(self, token_id: int) -> str:
        return spell_bytes(self.bytes_of(token_id))


class OffsetCursor:
    """Walks the tokens of one text in order (across stream chunks), giving each its string for
    `tokens` and its `text_offset`."""

    def __init__(self, token_text: TokenText) -> None:
        self.tt = token_text
        self.chars = 0  # whole characters of text so far
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token_id: int, in_text: bool = True) -> tuple[str, int]:
        """(string, offset) of the next token; one the text leaves out is spelt ""."""
        offset = self.chars
        if not in_text:
            return "", offset
        data = self.tt.bytes_of(token_id)
        self.chars += len(self._utf8.decode(data))
        return spell_bytes(data), offset


class SpecialStripper:
    """Takes the spellings of one choice's special tokens out of its text, delta by delta: what
    `skip_special_tokens` would have given, for text the engine decoded with them kept (`keep`:
    spellings left in, the tool parser's markers).

    A token's id comes with the delta that generated it, its text with that delta or a later
    one: the engine holds back text that may begin a stop string, so one spelling can arrive in
    two deltas (`stop=["]]"]` sends `[/INST` and then `]`). Each special's spelling is owed
    from its id on and taken out where it appears, in any order, so one whose decoded text
    differs from its spelling (never seen) does not keep later ones in the text. What is held
    back is only a suffix that may still become an owed spelling: shorter than the longest
    one, sent once it cannot (a literal `[/` that goes on otherwise), or at the end."""

    def __init__(self, token_text: TokenText, keep: Iterable[str] = ()) -> None:
        self.tt = token_text
        self.keep = frozenset(keep)
        self.owed: Counter[str] = Counter()
        self.held = ""

    def feed(self, text: str, token_ids: list[int], finished: bool = False) -> str:
        """The part of `text` (after what was held) that is sure not to be a special's
        spelling; `finished`: the last delta, which sends everything left."""
        for t in token_ids:
            if t in self.tt.special:
                spelling = self.tt.spell(t)
                if spelling and spelling not in self.keep:
                    self.owed[spelling] += 1
        text, out = self.held + text, []
        while (hit := self._first_owed(text)) is not None:
            i, spelling = hit
            out.append(text[:i])
            text = text[i + len(spelling):]
            self.owed[spelling] -= 1
            if not self.owed[spelling]:
                del self.owed[spelling]
        hold = 0 if finished else self._may_begin(text)
        self.held = text[len(text) - hold:] if hold else ""
        out.append(text[:len(text) - hold])
        return "".join(out)

    def _first_owed(self, text: str) -> tuple[int, str] | None:
        """(index, spelling) of the first owed spelling in `text` (the longest at a tie)."""
        hits = [(i, -len(s), s) for s in self.owed if (i := text.find(s)) >= 0]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def _may_begin(self, text: str) -> int:
        """The length of the longest suffix of `text` that is a proper prefix of an owed
        spelling."""
        longest = max((len(s) for s in self.owed), default=1)
        for k in range(min(longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.owed):
                return k
        return 0
