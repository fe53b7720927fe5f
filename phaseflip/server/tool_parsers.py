"""How a model's text becomes tool calls: the formats `tool_choice: "auto"` reads (Hermes/Qwen
`<tool_call>` blocks, Mistral `[TOOL_CALLS]` calls, Llama-3 JSON calls, Llama 3.2's pythonic
list), the `{"name", "arguments"}` call of `required`, and what a stream may send before it
knows (`may_begin_call`, `content_end`). `tools` plans requests and streams with these."""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"
PARSER_MARKERS = (MISTRAL_TAG, ARGS_TAG)
"""Special tokens the parser reads (Mistral's), which a request's text may keep for it."""
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)",
                    re.DOTALL)


def split_required(text: str) -> tuple[str, str] | None:
    """(name, arguments text) of a `{"name": ..., "arguments": ...}` call: the whole call, or
    one cut short (by `max_tokens`) after its name, whose arguments are then what came;
    None before the name is complete."""
    m = HEADER.match(text)
    if m is None:
        return None
    rest = text[m.end():].rstrip()
    if json_object(text) is not None:  # whole: the last brace closes the wrapper
        rest = rest[:-1].rstrip()
    return json.loads(f'"{m.group(1)}"'), rest


def auto_calls(text: str, names: set[str],
               parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """Hermes/Qwen blocks, Mistral `[TOOL_CALLS]` calls, or Llama-3 JSON calls; unparseable
    text stays content. Text with no marker is a call only when it is nothing but calls naming
    listed tools (a JSON answer the user asked for stays content): one or more Llama-3
    `{"name", "parameters"}` objects (separated by `;` or whitespace), a Mistral list of
    `{"name", "arguments"}` or `name{arguments}` (the two Mistral forms whose special marker
    tokens `skip_special_tokens` took out), or a Llama 3.2 pythonic list. The content before a
    call loses its trailing whitespace (a stream holds that back until it knows)."""
    calls: list[tuple[str, str]] = []
    head = text
    if TOOL_OPEN in text:
        head = text[: text.index(TOOL_OPEN)]
        for block in _BLOCK.findall(text):
            obj = json_object(block)
            call = _call(obj, None, {}) if obj is not None else None
            if call is not None:
                calls.append(call)
    elif MISTRAL_TAG in text:
        i = text.index(MISTRAL_TAG)
        head, calls = text[:i], _call_sequence(text[i:].replace(MISTRAL_TAG, " "), None)
    else:
        body = text.strip()
        tagged = body.startswith(PYTHON_TAG)
        calls = _call_sequence(body[len(PYTHON_TAG):] if tagged else body,
                               None if tagged else names)
        if not calls and not tagged:
            calls = _pythonic_calls(body, names)
        head = ""
    if not calls:
        return text, []
    return (head.rstrip() if head.strip() else None), calls if parallel else calls[:1]


_DECODER = json.JSONDecoder()
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)\s*(\[ARGS\])?\s*(?=\{)")
"""Mistral's newer form, `name[ARGS]{...}` (`name{...}` once `[ARGS]` was skipped)."""
_NAME_FIRST = re.compile(r'\[?\s*\{\s*"name"\s*:')


def _call_sequence(text: str, names: set[str] | None) -> list[tuple[str, str]]:
    """The calls `text` is made of, all or nothing: JSON call objects or lists of them, or
    `name[ARGS]{...}`, separated by whitespace, `;` or `,`. `names`: the only names that count
    (None: any, after a marker)."""
    calls: list[tuple[str, str]] = []
    pos, n = 0, len(text)
    while True:
        while pos < n and (text[pos].isspace() or text[pos] in ";,"):
            pos += 1
        if pos == n:
            return calls
        m = _NAMED.match(text, pos)
        try:
            if m and (m.group(2) or (names is not None and m.group(1) in names)):
                args, pos = _DECODER.raw_decode(text, m.end())
                objs = [{"name": m.group(1), "arguments": args}]
            elif names is not None and not _NAME_FIRST.match(text, pos):
                return []  # (unmarked: `"name"` first, as models write it, and a stream tells)
            else:
                value, pos = _DECODER.raw_decode(text, pos)
                objs = value if isinstance(value, list) and value else [value]
        except ValueError:  # (JSONDecodeError, or an int past Python's 4 300-digit limit)
            return []
        for obj in objs:
            call = _call(obj, names, None) if isinstance(obj, dict) else None
            if call is None:
                return []
            calls.append(call)


def _call(obj: dict[str, Any], names: set[str] | None,
          missing: dict[str, Any] | None) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object: its `arguments` (or Llama's
    `parameters`) an object, or JSON text of one (as some models write it); `missing`: what
    absent arguments count as (None: not a call)."""
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", missing))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(name, str) or not isinstance(args, dict) or (
            names is not None and name not in names):
        return None
    try:
        return name, _dumps(args)
    except ValueError:
        return None


def _pythonic_calls(text: str, names: set[str]) -> list[tuple[str, str]]:
    """Llama 3.2's pythonic calls, `[get_weather(city="Paris"), get_time()]`: all of `text`,
    each call naming a listed tool, with keyword arguments that are literals (`_literal`);
    else none. `ast` only parses: nothing is evaluated."""
    if not (text.startswith("[") and text.endswith("]")):
        return []
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (NUL bytes, too deep)
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in names and not node.args):
            return []
        keys = [kw.arg for kw in node.keywords]
        if None in keys or len(set(keys)) < len(keys):  # (`**kw`, a name given twice)
            return []
        try:
            text = _dumps({kw.arg: _literal(kw.value) for kw in node.keywords})
        except ValueError:
            return []
        calls.append((node.func.id, text))
    return calls


def _dumps(args: dict[str, Any]) -> str:
    """Arguments as JSON text a response can carry. ValueError (UnicodeEncodeError is one) for
    an int past Python's digit limit or a lone surrogate (`"\\ud800"` decodes to one): the
    model's text is then content, never a 500."""
    text = json.dumps(args, ensure_ascii=False)
    text.encode("utf-8")
    return text


_SCALARS = (str, int, float, bool, type(None))


def _literal(node: ast.expr) -> Any:
    """The JSON value a pythonic argument spells: a string, a finite number, a bool or None,
    or a list or a string-keyed dict of them. ValueError for anything else (a name, a call,
    an operation, a tuple, bytes), which makes the text content."""
    if isinstance(node, ast.Constant) and type(node.value) in _SCALARS:
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(
            node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -_literal(node.operand)
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(
            isinstance(k, ast.Constant) and type(k.value) is str for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"not a literal: {type(node).__name__}")


def json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text.strip())
    except ValueError:  # (JSONDecodeError, or an int past Python's 4 300-digit limit)
        return None
    return obj if isinstance(obj, dict) else None


_WORD = re.compile(r"[A-Za-z0-9_.\-]+")


def may_begin_call(start: str, names: set[str]) -> bool:
    """Whether an auto answer's text so far (less leading whitespace) may still begin a call
    with no `<tool_call>` or `[TOOL_CALLS]` marker before it (what `_call_sequence` or
    `_pythonic_calls` take with `names`): False only when it cannot, so the stream holds
    nothing longer than needed and never sends as content what the whole answer calls."""
    if any(t.startswith(start) or start.startswith(t) for t in (PYTHON_TAG, MISTRAL_TAG)):
        return True
    if _WORD.match(start):  # Mistral's `name{...}` or `name[ARGS]{...}`
        return _may_name(start, names, ("{", ARGS_TAG))
    s = start[1:].lstrip() if start.startswith("[") else start
    if not s:
        return True
    if _WORD.match(s):  # Llama 3.2's `[name(...), ...]`
        return _may_name(s, names, ("(",))
    if s[0] != "{":
        return False
    s = s[1:].lstrip()
    key = '"name"'
    if not s.startswith(key):
        return key.startswith(s)
    s = s[len(key):].lstrip()
    if s[:1] != ":":
        return not s
    s = s[1:].lstrip()
    if s[:1] != '"':
        return not s
    s = s[1:]
    j = s.find('"')
    name = s if j < 0 else s[:j]
    if "\\" in name:  # (escaped: told at the end)
        return True
    return any(n.startswith(name) for n in names) if j < 0 else name in names


def _may_name(s: str, names: set[str], opens: tuple[str, ...]) -> bool:
    """Whether `s`, which begins with a word, may begin a listed tool's name followed (after
    any whitespace) by one of `opens`."""
    m = _WORD.match(s)
    word, rest = m.group(), s[m.end():]
    if not rest:
        return any(n.startswith(word) for n in names)
    rest = rest.lstrip()
    return word in names and (not rest or any(
        rest.startswith(o) or o.startswith(rest) for o in opens))


def content_end(text: str) -> int:
    """How much of an unfinished auto answer's `text` is content for sure: all but a suffix
    that may begin a `<tool_call>` or `[TOOL_CALLS]` and the whitespace before it (content
    before a call ends without it)."""
    hold = 0
    for tag in (TOOL_OPEN, MISTRAL_TAG):
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-k:]):
                hold = max(hold, k)
                break
    return len(text[: len(text) - hold].rstrip())
