"""Keeping UTF-8 surrogates out of xgrammar grammars (issue 20).

xgrammar (0.2.9) reads the UTF-8 form of a surrogate (ED A0-BF 80-BF: U+D800-U+DFFF) as one
character of any class that spans it, though it is not UTF-8: every decoder turns its three
bytes into three U+FFFD, so a `maxLength` 12 string with one reached the client 14 characters
long (1.2 % of random-token answers to benchmarks/schemas/nested.json). No text holds a
surrogate, so taking them out of every class changes nothing a client can see but that.

`without_surrogates` rewrites a grammar as xgrammar prints it: each character class loses the
range, and the regexes of `Regex("...")` macros (a JSON schema's `pattern`s, compiled from
the printed text) lose it from `.`, `\\S`, `\\W`, `\\D` and their classes.

`find_lone_surrogate` and `lone_surrogate_problem` are the one check of input text for them
(a JSON "\\ud800" or undecodable input makes one; no tokenizer encodes it), shared by the
HTTP request models and the offline `Engine.encode`, which must not import the server layer.
"""

from __future__ import annotations

import re

SURROGATES = (0xD800, 0xDFFF)
_LONE = re.compile("[\ud800-\udfff]")
_SUR = "\\ud800-\\udfff"  # the range as the grammar and the regex syntax both write it
_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_NEGATED = "SWD"  # regex escapes that match a surrogate (\s, \w, \d do not)


def find_lone_surrogate(text: str) -> int | None:
    """Index of the first surrogate code point in `text`, or None: a `str` may hold one, but
    it is not Unicode text (UTF-8 cannot encode it, a tokenizer raises a TypeError)."""
    found = None if text.isascii() else _LONE.search(text)
    return None if found is None else found.start()


def lone_surrogate_problem(text: str, index: int) -> str:
    """What is wrong with `text`, whose `find_lone_surrogate` is `index`: the words every
    caller answers with, after its own subject ("the prompt", a field path)."""
    escaped = text[index].encode("unicode_escape").decode()
    return (f"contains a lone surrogate ({escaped}) at character {index}; "
            "text must be valid Unicode")


def _char(text: str, i: int) -> tuple[int, int]:
    """(code point, index after it) of the possibly escaped character at text[i]: a literal,
    a one-letter escape, \\xHH, \\uHHHH, \\u{H...} or \\UHHHHHHHH."""
    if text[i] != "\\":
        return ord(text[i]), i + 1
    e = text[i + 1]
    if e == "u" and text[i + 2 : i + 3] == "{":
        end = text.index("}", i)
        return int(text[i + 3 : end], 16), end + 1
    if e in _HEX_DIGITS:
        end = i + 2 + _HEX_DIGITS[e]
        return int(text[i + 2 : end], 16), end
    return _ESCAPES.get(e, ord(e)), i + 2


def _split(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    s_lo, s_hi = SURROGATES
    return [(a, b) for lo, hi in ranges
            for a, b in ((lo, min(hi, s_lo - 1)), (max(lo, s_hi + 1), hi)) if a <= b]


def _escaped(c: int) -> str:
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" if c < 0x10000 else f"\\U{c:08x}"


def _class(text: str, i: int, regex: bool) -> tuple[str, int]:
    """(the class opening at text[i] without surrogates, index after it). A negated class
    excludes them; a positive one loses them from its ranges (in a regex, a `\\S`, `\\W` or
    `\\D` in it becomes an alternative). Kept as is if it held nothing else."""
    start, i = i, i + 1
    negated = text[i] == "^"
    i += negated
    ranges: list[tuple[int, int]] = []
    verbatim: list[str] = []  # regex class escapes kept as written (\s, \w, \d)
    negs: list[str] = []  # regex class escapes that match surrogates
    while text[i] != "]":
        if regex and text[i] == "\\" and text[i + 1] in "sSwWdD":
            (negs if text[i + 1] in _NEGATED else verbatim).append(text[i + 1])
            i += 2
            continue
        lo, i = _char(text, i)
        hi = lo
        if text[i] == "-" and text[i + 1] != "]":
            hi, i = _char(text, i + 1)
        ranges.append((lo, hi))
    end = i + 1
    if negated:
        covered = any(lo <= SURROGATES[0] and hi >= SURROGATES[1] for lo, hi in ranges)
        return (text[start:end] if covered else text[start:i] + _SUR + "]"), end
    kept = _split(ranges)
    if (kept == ranges and not negs) or not (kept or verbatim or negs):
        return text[start:end], end
    pos = "".join(_escaped(lo) + (f"-{_escaped(hi)}" if hi > lo else "") for lo, hi in kept)
    pos += "".join("\\" + e for e in verbatim)
    alternatives = ([f"[{pos}]"] if pos else []) + [f"[^\\{e.lower()}{_SUR}]" for e in negs]
    return (alternatives[0] if len(alternatives) == 1 else f"({'|'.join(alternatives)})"), end


def regex_without_surrogates(pattern: str) -> str:
    """`pattern` (xgrammar's regex syntax) matching what it did, less surrogates."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern[i + 1 : i + 2] in tuple(_NEGATED):
            out.append(f"[^\\{pattern[i + 1].lower()}{_SUR}]")
            i += 2
        elif c == "\\":
            out.append(pattern[i : i + 2])
            i += 2
        elif c == ".":
            out.append(f"[^{_SUR}]")
            i += 1
        elif c == "[":
            cls, i = _class(pattern, i, regex=True)
            out.append(cls)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _literal(text: str, i: int) -> tuple[str, int]:
    """(the value of the grammar string literal opening at text[i], index after it)."""
    chars: list[str] = []
    i += 1
    while text[i] != '"':
        c, i = _char(text, i)
        chars.append(chr(c))
    return "".join(chars), i + 1


def _quoted(value: str) -> str:
    """`value` as a grammar string literal (ASCII, escaped as xgrammar reads it)."""
    body = "".join("\\" + ch if ch in '"\\' else ch if " " <= ch <= "~" else _escaped(ord(ch))
                   for ch in value)
    return f'"{body}"'


def without_surrogates(text: str) -> str:
    """The printed grammar `text` with no class, nor `Regex(...)` macro, matching a surrogate."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == '"':
            j = i + 1  # a literal: copied through its closing quote
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            literal = text[i : j + 1]
            if text[max(0, i - 6) : i] == "Regex(":
                pattern = _literal(text, i)[0]
                fixed = regex_without_surrogates(pattern)
                literal = literal if fixed == pattern else _quoted(fixed)
            out.append(literal)
            i = j + 1
        elif c == "[":
            cls, i = _class(text, i, regex=False)
            out.append(cls)
        else:
            out.append(c)
            i += 1
    return "".join(out)
