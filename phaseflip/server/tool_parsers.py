"""How a model's text becomes tool calls: the formats `tool_choice: "auto"` reads (Hermes/Qwen
`<tool_call>` blocks, Mistral `[TOOL_CALLS]` calls, Llama-3 JSON calls, Llama 3.2's pythonic
list), the `{"name", "arguments"}` call of `required`, and `AutoReader`, which reads an auto
answer as it comes, so that a stream sends content and calls as soon as they are certain and
the whole answer is what its stream adds up to. `tools` plans requests and streams with
these."""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, ARGS_TAG = "[TOOL_CALLS]", "[ARGS]"
PARSER_MARKERS = (MISTRAL_TAG, ARGS_TAG)
"""Special tokens the parser reads (Mistral's), which a request's text may keep for it."""
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


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


def _call(obj: dict[str, Any], names: set[str] | None,
          missing: dict[str, Any] | None) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a parsed call object: its `arguments` (or Llama's
    `parameters`) an object, or JSON text of one (as some models write it); `missing`: what
    absent arguments count as (None: not a call)."""
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", missing))
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(name, str) or not isinstance(args, dict) or len(name) > NAME_CAP or (
            names is not None and name not in names):
        return None
    try:
        name.encode("utf-8")  # (a lone surrogate, as `_dumps` refuses in the arguments)
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
    except (ValueError, RecursionError):  # (JSONDecodeError, an int past Python's 4 300-digit
        return None  # limit, or nested deeper than the interpreter's recursion limit)
    return obj if isinstance(obj, dict) else None


def _is_json(text: str) -> bool:
    """Whether `text` is JSON (numbers not converted: an int past Python's digit limit is)."""
    try:
        json.loads(text, parse_int=str, parse_float=str, parse_constant=str)
    except (ValueError, RecursionError):
        return False
    return True


def content_end(text: str, tags: tuple[str, ...] = (TOOL_OPEN, MISTRAL_TAG)) -> int:
    """How much of an unfinished auto answer's `text` is content for sure: all but a suffix
    that may begin one of `tags` (by default a `<tool_call>` or `[TOOL_CALLS]`; a marker kept
    for the parser too, which the content leaves out whole) and the whitespace before it
    (content before a call ends without it)."""
    return _rstripped(text, len(text) - _held(text, tags))


def _held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest suffix of `text` that begins one of `tags`."""
    hold = 0
    for tag in tags:  # (only where the tag's first character is: none in a whitespace run)
        i = max(0, len(text) - len(tag) + 1)
        while (i := text.find(tag[0], i)) >= 0:
            if tag.startswith(text[i:]):
                hold = max(hold, len(text) - i)
                break
            i += 1
    return hold


def _rstripped(text: str, end: int) -> int:
    """`len(text[:end].rstrip())`, without copying a long text each delta."""
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


# ------------------------------------------------------------------ reading as text comes
_MORE, _FAIL = "more", "fail"
"""What the start of a call says so far: the text ends before it tells; it is not a call."""
_WORD = re.compile(r"[A-Za-z0-9_.\-]+")
_SPACE = re.compile(r"\s*")
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
# The longest name a call may have (OpenAI's function names: 64 characters), and the most
# characters its JSON text may take (escapes: up to 6 a character). A property of the text,
# so that a stream and the whole answer agree; and it bounds the name's scan a delta (an
# unclosed name was matched again over its whole length at every delta: quadratic).
NAME_CAP = 256
_NAME_TEXT = 6 * NAME_CAP
# The most characters a call's start may take before it tells whether it is a call: from the
# `{` or `[` (or first letter) that opens it to what decides it (the `{` of its arguments; at
# an answer's start, what follows a `[`). The longest a real start needs is a name's text
# (`_NAME_TEXT`) and its keys, ~1 570; the rest is room for whitespace, which no model writes
# by the kilobyte there. A property of the text, as NAME_CAP; and a start is read again from
# its beginning at each delta until it tells, so it bounds that (a whitespace run after a `[`
# or `{` was rescanned whole every delta: 15 to 24 s for 200 000 spaces, 4 a delta).
START_CAP = 4096
_OUTSIDE = re.compile(r'[{}\[\]"<]')
_INSIDE = re.compile(r'["\\]')
_ARGS_KEYS = ('"arguments"', '"parameters"')
_Head = tuple[Any, ...]
"""An item's start: ("open", name, where its arguments' `{` is) or ("whole", where the object
to read whole begins), else _MORE or _FAIL."""


class _Scan:
    """Where a JSON object (or list) that opens at `pos` closes, each character read once
    however the text arrives: brackets counted outside strings. `close` (a Hermes block's
    `</tool_call>`) outside a string cuts it short, as the text's end does when it is the
    last (`whole` stays False)."""

    def __init__(self, pos: int, depth: int = 0, close: str | None = None) -> None:
        self.pos, self.depth, self.close = pos, depth, close
        self.in_string = self.whole = False

    def run(self, text: str, finished: bool) -> int | None:
        """Where it ends, or None: not yet (all before `pos` is its text)."""
        while (m := (_INSIDE if self.in_string else _OUTSIDE).search(text, self.pos)):
            c, i = m.group(), m.start()
            if c == "\\":
                if i + 1 == len(text):  # (the escaped character is to come)
                    self.pos = i
                    return len(text) if finished else None
                self.pos = i + 2
            elif c == '"':
                self.in_string, self.pos = not self.in_string, i + 1
            elif c == "<":
                if self.close is not None and text.startswith(self.close, i):
                    self.pos = i
                    return i
                if (self.close is not None and not finished and len(text) - i < len(self.close)
                        and self.close.startswith(text[i:])):
                    self.pos = i
                    return None
                self.pos = i + 1
            else:
                self.depth += 1 if c in "{[" else -1
                self.pos = i + 1
                if self.depth <= 0:
                    self.whole = True
                    return self.pos
        self.pos = len(text)
        return len(text) if finished else None


def _ws(text: str, j: int) -> int:
    return _SPACE.match(text, j).end()


def _expect(text: str, j: int, parts: tuple[str | tuple[str, ...], ...]) -> tuple[int, str]:
    """Reads `parts` (a tuple part: one of them) at `j`, whitespace before each: (where they
    end, "ok"), else (where they stopped, _MORE when the text ends inside them, or "no")."""
    for part in parts:
        j = _ws(text, j)
        choices = part if isinstance(part, tuple) else (part,)
        hit = next((c for c in choices if text.startswith(c, j)), None)
        if hit is None:
            more = any(len(text) - j < len(c) and c.startswith(text[j:]) for c in choices)
            return j, _MORE if more else "no"
        j += len(hit)
    return j, "ok"


def _unquote(body: str) -> str | None:
    """A JSON string's text, or None (not JSON, or a lone surrogate no response can carry)."""
    try:
        text = json.loads(f'"{body}"')
        text.encode("utf-8")
    except ValueError:  # (UnicodeEncodeError is one)
        return None
    return text


def _object_head(text: str, i: int, names: set[str] | None) -> _Head | str:
    """An object at `i` as a call: "open" once `"name"` (a listed one, with `names`) and the
    `{` of its arguments came; "whole" for another object, which is read whole (other keys
    first, arguments as JSON text); with `names` a `"name"` not first or not listed fails."""
    lax = ("whole", i) if names is None else _FAIL
    j, got = _expect(text, i + 1, ('"name"', ":"))
    if got != "ok":
        return _MORE if got == _MORE else lax
    j = _ws(text, j)
    m = _STRING.match(text, j, min(len(text), j + _NAME_TEXT + 2))
    if m is None:
        if text[j:j + 1] not in ("", '"') or len(text) - j > _NAME_TEXT + 1:
            return lax
        part = text[j + 1:]
        listed = names is None or any(n.startswith(part) for n in names) or (
            "\\" in part and len(part) <= 6 * max(map(len, names), default=0))
        return _MORE if listed else _FAIL
    name = _unquote(m.group(1))
    if name is None or len(name) > NAME_CAP or (names is not None and name not in names):
        return lax
    j, got = _expect(text, m.end(), (",", _ARGS_KEYS, ":"))
    j = _ws(text, j)
    if got == _MORE or (got == "ok" and j == len(text)):
        return _MORE
    return ("open", name, j) if got == "ok" and text[j] == "{" else ("whole", i)


def _named_head(text: str, i: int, names: set[str] | None) -> _Head | str:
    """Mistral's `name[ARGS]{...}` at `i` (`name{...}` once `[ARGS]` was skipped), "open" at
    its `{`: with `names` the name is a listed one, without (after a marker) `[ARGS]` came."""
    word, j = (m := _WORD.match(text, i)).group(), m.end()
    if len(word) > NAME_CAP:
        return _FAIL
    if j == len(text):
        return _MORE if names is None or any(n.startswith(word) for n in names) else _FAIL
    if names is not None and word not in names:
        return _FAIL
    j = _ws(text, j)
    tagged = text.startswith(ARGS_TAG, j)
    if tagged:
        j = _ws(text, j + len(ARGS_TAG))
    if j == len(text) or not tagged and len(text) - j < len(ARGS_TAG) and ARGS_TAG.startswith(
            text[j:]):
        return _MORE
    if text[j] != "{" or not (tagged or names is not None):
        return _FAIL
    if not tagged:  # a bare `name {`: JSON's `{"` or `{}` only, so prose (`get_weather {city}
        k = _ws(text, j + 1)  # returns …`) stays content
        if k == len(text):
            return _MORE
        if text[k] not in '"}':
            return _FAIL
    return ("open", word, j)


def _item_head(text: str, i: int, names: set[str] | None) -> _Head | str:
    if text[i] == "{":
        return _object_head(text, i, names)
    return _named_head(text, i, names) if _WORD.match(text, i) else _FAIL


_Read = Callable[[str, int, set[str] | None], _Head | str]


def _capped(read: _Read, text: str, i: int, names: set[str] | None) -> _Head | str:
    """`read`'s start of the call at `i`, told from the START_CAP characters there: one still
    undecided at their end is no call, whole or streamed alike, and a delta reads no more."""
    window = text[i:i + START_CAP]
    head = read(window, 0, names)
    if head == _MORE:
        return _FAIL if len(window) == START_CAP else _MORE
    if head == _FAIL:
        return head
    return ("open", head[1], i + head[2]) if head[0] == "open" else ("whole", i)


def _list_head(text: str, names: set[str]) -> str:
    """An answer's opening `[` (`text`: its START_CAP characters from it): "pythonic" for Llama
    3.2's `[name(...)`, "items" for something else (JSON calls, maybe), _MORE or _FAIL (also
    when START_CAP characters leave it undecided, as `_capped`)."""
    k = _ws(text, 1)
    if k < len(text) and not _WORD.match(text, k):
        return "items"
    head = _MORE if k == len(text) else _pythonic_head(text, k, names)
    return _FAIL if head == _MORE and len(text) == START_CAP else head


def _pythonic_head(text: str, k: int, names: set[str]) -> str:
    """Llama 3.2's `[name(...), ...]`, its first name at `k`: "pythonic", _MORE or _FAIL."""
    word, j = (m := _WORD.match(text, k)).group(), m.end()
    if j == len(text):
        return _MORE if any(n.startswith(word) for n in names) else _FAIL
    j = _ws(text, j)
    if word not in names:
        return _FAIL
    return _MORE if j == len(text) else "pythonic" if text[j] == "(" else _FAIL


def _next_item(text: str, j: int) -> tuple[int, bool]:
    """(where the next call may begin at or after `j`, past what separates calls (whitespace,
    `;`, `,`, list brackets, `[TOOL_CALLS]`), True); (how far the separators go, False): the
    text ends first (maybe in a marker), and reading goes on from there."""
    n = len(text)
    while j < n:
        if text.startswith(MISTRAL_TAG, j):
            j += len(MISTRAL_TAG)
        elif n - j < len(MISTRAL_TAG) and MISTRAL_TAG.startswith(text[j:]):
            return j, False
        elif text[j].isspace() or text[j] in ";,[]":
            j += 1
        else:
            return j, True
    return j, False


@dataclass
class AutoReader:
    """An auto answer read as it comes (whole: one `feed`, `finished`), so that a stream sends
    what the whole answer has, in order: content, then calls, each named once it is certain
    (its name whole, the `{` of its arguments come too) and its arguments as they arrive.

    Calls begin at a `<tool_call>` (Hermes/Qwen blocks: a block that is not a call is left out)
    or at a `[TOOL_CALLS]` (Mistral: JSON calls, lists of them, `name[ARGS]{...}`), content
    before them; or the answer begins with them (listed names only): Llama-3 JSON calls, Mistral
    forms whose markers were skipped, `<|python_tag|>` calls, Llama 3.2's pythonic list. Calls
    that fail before the first is certain make the answer content; once one is, the text after
    the last call is left out. Arguments are the text the model wrote: a call cut short keeps
    what came (`whole` False). Arguments as JSON text or in another key order are sent whole
    at the object's end, and pythonic calls (one Python expression, told at its end) at the
    answer's: both are normalised (`_dumps`)."""

    names: set[str]
    parallel: bool = True
    hold: tuple[str, ...] = (TOOL_OPEN, MISTRAL_TAG)  # what content holds the start of
    text: str = ""
    mode: str = "start"  # start, plain, content, items, hermes, pythonic, done
    sent: int = 0  # content sent
    pos: int = 0  # where reading goes on
    within: set[str] | None = None  # the names calls may have (None: any, after a marker)
    marked: bool = False  # items after `[TOOL_CALLS]`: if not calls, content
    seeking: bool = False  # hermes: for the next `<tool_call>`
    calls: list[list[Any]] = field(default_factory=list)  # [name, arguments, whole]
    scan: _Scan | None = None
    step: str = ""  # what `scan` reads: "args", "wrapper" (the call's object after), "object"
    at: int = 0  # where the arguments or object `scan` reads begin
    out: list[str] = field(default_factory=list)
    events: list[tuple[int, str | None, str]] = field(default_factory=list)
    blank: tuple[int, int] = (0, 0)  # text[a:b] is whitespace (`_content`'s last search)
    looked: int = 0  # plain: no marker begins in text[sent:looked] (`_plain`'s last search)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[tuple[int, str | None, str]]]:
        """(content, [(call index, name: its first piece, else None, arguments piece)])."""
        text, self.text = self.text, ""  # grown in place (see `IncrementalDetokenizer._append`)
        text += delta
        self.text = text
        self.out, self.events = [], []
        while getattr(self, "_" + self.mode)(finished):
            pass
        return "".join(self.out), self.events

    @property
    def whole(self) -> bool:
        """Whether every call's arguments closed (none was cut short)."""
        return all(c[2] for c in self.calls)

    def _send(self, end: int) -> None:
        if end > self.sent:
            self.out.append(self.text[self.sent:end])
            self.sent = end

    def _start(self, finished: bool) -> bool:
        """Only whitespace came: the answer may begin with calls, held until it tells."""
        text = self.text
        self.pos = s = _ws(text, self.pos)
        if text.startswith(PYTHON_TAG, s):
            return self._to_items(s + len(PYTHON_TAG), None, False)
        if len(text) - s < len(PYTHON_TAG) and PYTHON_TAG.startswith(text[s:]):
            if finished:
                self.mode = "plain"
            return finished
        head = _list_head(text[s:s + START_CAP], self.names) if text[s] == "[" else "items"
        if head == "items":
            return self._to_items(s, self.names, False)
        if head == _MORE and not finished:
            return False
        self.mode = "pythonic" if head == "pythonic" else "plain"
        return True

    def _to_items(self, pos: int, within: set[str] | None, marked: bool) -> bool:
        self.mode, self.pos, self.within, self.marked = "items", pos, within, marked
        return True

    def _plain(self, finished: bool) -> bool:
        """Content, until a `<tool_call>` or `[TOOL_CALLS]` begins calls."""
        text, start = self.text, max(self.sent, self.looked)
        hits = [(k, tag) for tag in (TOOL_OPEN, MISTRAL_TAG) if (k := text.find(tag, start)) >= 0]
        if not hits:  # (held-back whitespace is not searched again each delta)
            self.looked = max(start, len(text) - max(len(TOOL_OPEN), len(MISTRAL_TAG)) + 1)
            return self._content(finished)
        k, tag = min(hits)
        self._send(_rstripped(text, k))
        if tag == MISTRAL_TAG:
            return self._to_items(k + len(tag), None, True)
        self.mode, self.pos, self.marked, self.within = "hermes", k + len(tag), True, None
        return True

    def _content(self, finished: bool) -> bool:
        text = self.text
        if finished:
            self._send(len(text))
            return False
        end = len(text) - _held(text, self.hold)
        i = end  # (the blank run ending at `end`, reusing the one found last time)
        while i > self.sent and text[i - 1].isspace():
            if self.blank[0] < i <= self.blank[1]:
                i = self.blank[0]
                break
            i -= 1
        self.blank = (i, end)
        self._send(i)
        return False

    def _done(self, finished: bool) -> bool:
        return False

    def _pythonic(self, finished: bool) -> bool:
        if not finished:
            return False
        calls = _pythonic_calls(self.text.strip(), self.names)
        for name, args in calls[:None if self.parallel else 1]:
            self._add(name, args, True)
        self.mode = "done" if calls else "plain"
        return True

    def _items(self, finished: bool) -> bool:
        """Calls one after another (`_next_item`)."""
        if self.scan is not None:
            return self._read(finished)
        self.pos, ready = _next_item(self.text, self.pos)
        if not ready:
            return finished and self._end()
        head = _capped(_item_head, self.text, self.pos, self.within)
        return (head != _MORE or finished) and self._begin(head)

    def _hermes(self, finished: bool) -> bool:
        """`<tool_call>` blocks, one JSON call each; text around them is left out."""
        if self.scan is not None:
            return self._read(finished)
        text = self.text
        if self.seeking:
            k = text.find(TOOL_OPEN, self.pos)
            if k < 0:
                self.pos = max(self.pos, len(text) - len(TOOL_OPEN) + 1)
                return finished and self._end()
            self.pos, self.seeking = k + len(TOOL_OPEN), False
        self.pos = j = _ws(text, self.pos)
        if j == len(text):
            return finished and self._end()
        head = _capped(_object_head, text, j, None) if text[j] == "{" else _FAIL
        return (head != _MORE or finished) and self._begin(head)

    def _begin(self, head: _Head | str) -> bool:
        if head in (_MORE, _FAIL):
            return self._fail()
        close = TOOL_CLOSE if self.mode == "hermes" else None
        if head[0] == "open":
            self._add(head[1], "", False)
            self.step, self.at = "args", head[2]
        else:
            self.step, self.at = "object", head[1]
        self.scan = _Scan(self.at, close=close)
        return True

    def _add(self, name: str, args: str, whole: bool) -> None:
        self.calls.append([name, args, whole])
        self.events.append((len(self.calls) - 1, name, args))

    def _read(self, finished: bool) -> bool:
        """Goes on with what `scan` reads; a call's arguments are sent as they come."""
        scan, text = self.scan, self.text
        end = scan.run(text, finished)
        if self.step == "args":
            call, done = self.calls[-1], self.at + len(self.calls[-1][1])
            upto = scan.pos if end is None else end
            if upto > done:
                args, call[1] = call[1], ""  # grown in place (as `text` in `feed`)
                args += text[done:upto]
                call[1] = args
                self.events.append((len(self.calls) - 1, None, text[done:upto]))
            if end is None:
                return False
            call[2] = scan.whole and _is_json(call[1])
            if scan.whole and text[self.pos] == "{":  # (the rest of its wrapper object)
                self.scan, self.step = _Scan(end, 1, scan.close), "wrapper"
                return True
            return self._after(end)
        if end is None:
            return False
        if self.step == "object":
            obj = json_object(text[self.at:end])
            call = _call(obj, self.within, {} if self.mode == "hermes" else None) if (
                obj is not None) else None
            if call is None:
                self.pos = end
                return self._fail()
            self._add(*call, True)
        return self._after(end)

    def _after(self, end: int) -> bool:
        """A call ended at `end`."""
        self.scan, self.pos, self.seeking = None, end, True
        if not self.parallel:
            self.mode = "done"
        return True

    def _fail(self) -> bool:
        """What was read is not a call: a Hermes block is left out, other calls end."""
        self.scan = None
        if self.mode == "hermes":
            self.seeking = True
            return True
        return self._end()

    def _end(self) -> bool:
        """No more calls: with none, the answer is content (from the marker, or all of it)."""
        self.mode = "done" if self.calls else "content" if self.marked else "plain"
        return True


def auto_calls(text: str, names: set[str], parallel: bool = True
               ) -> tuple[str | None, list[tuple[str, str]], bool]:
    """(content, [(name, arguments)], whether every call is whole) of a finished auto answer:
    an `AutoReader` given it at once, so what a stream of it sends adds up to the same. Content
    before calls ends without its whitespace (None if nothing else); with no call, the text
    is content."""
    reader = AutoReader(names, parallel)
    content, _ = reader.feed(text, True)
    if not reader.calls:
        return text, [], True
    return content or None, [(name, args) for name, args, _ in reader.calls], reader.whole
