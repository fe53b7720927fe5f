"""Tool calls on `/v1/chat/completions`: which mode, what the model is shown, what it must
generate, and how its text becomes `tool_calls` (whole, or as stream deltas).

Modes (`tool_choice`): "none" (tools are not shown), "auto" (shown; the text is parsed for
Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks, Mistral `[TOOL_CALLS]`
calls or Llama-3 JSON calls `{"name", "parameters"}`; text with no marker is a call only when
it is nothing but calls naming listed tools), "required" (the output is constrained to one
`{"name": ..., "arguments": {...}}` object naming a listed tool) and a named function (the
output is constrained to that tool's arguments object). The two constrained modes always
parse. A chat template that knows tools gets them (`tools=`); any other gets a Hermes-style
system prompt listing them.

Arguments are the generated JSON text itself, so a streamed call's argument fragments
concatenate to exactly the arguments of the same call answered whole.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from phaseflip.errors import InvalidRequestError
from phaseflip.sampling.grammar import GrammarSpec
from phaseflip.server import protocol as p

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG = "[TOOL_CALLS]"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_BLOCK = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)",
                    re.DOTALL)
_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


@dataclass
class ToolPlan:
    """The tools of one chat request and how they are to be used."""

    tools: list[dict[str, Any]]  # the `function` objects: name, description, parameters
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    grammar: GrammarSpec | None = None
    parallel: bool = True  # `parallel_tool_calls`: false keeps an auto answer's first call

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.tools}

    def parameters(self, name: str) -> dict[str, Any]:
        fn = next(f for f in self.tools if f["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def finish_reason(self, reason: str | None, called: bool, text: str) -> str | None:
        """An answer that called tools and ended by itself finishes with "tool_calls", except
        under a named tool_choice, where OpenAI (and vLLM after it) says "stop": clients
        that branch on the reason see what they would from OpenAI. A required call cut short
        by a user stop string (its `text` not a whole call) says "stop": a client told
        "tool_calls" would run arguments that are not whole."""
        if self.mode == "named" or reason != "stop" or not called:
            return reason
        whole = self.mode != "required" or _json_object(text) is not None
        return "tool_calls" if whole else reason


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out, seen = [], set()
    for i, tool in enumerate(tools):
        kind = tool.get("type", "function") if isinstance(tool, dict) else None
        fn = tool.get("function") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(
                'each tool must be {"type": "function", "function": {"name": ...}}',
                f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequestError("a tool function needs a name", f"tools[{i}].function.name")
        if fn["name"] in seen:  # a call naming it could not say which one it meant
            raise InvalidRequestError(f"tool function names must be unique; {fn['name']!r} "
                                      "is given twice", f"tools[{i}].function.name")
        seen.add(fn["name"])
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError("function parameters must be a JSON schema object",
                                      f"tools[{i}].function.parameters")
        out.append(fn)
    return out


def _mode(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                "tool_choice")
        if choice == "required" and not names:
            raise InvalidRequestError("tool_choice required needs tools", "tool_choice")
        return choice, None
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            "tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools",
                                  "tool_choice")
    return "named", name


def plan_tools(req: p.ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (None: no tools in play); 400 for inconsistent tools."""
    tools = _functions(req.tools or [])
    mode, name = _mode(req.tool_choice, [f["name"] for f in tools])
    if mode == "none" and not tools:
        return None
    plan = ToolPlan(tools, mode, name, parallel=req.parallel_tool_calls is not False)
    if mode in ("required", "named"):
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequestError(
                f"response_format cannot be combined with tool_choice {mode!r}: both constrain "
                "the output", "response_format")
        plan.grammar = GrammarSpec.json_schema(_call_schema(plan))  # (checked by the caller)
    return plan


_DEFS_KEYS = ("$defs", "definitions")
"""Where a JSON schema keeps the subschemas its root-relative `$ref`s (`#/$defs/Name`) name."""


def _call_schema(plan: ToolPlan) -> dict[str, Any]:
    """What a constrained answer must match: the named tool's arguments, or (required) one
    `{"name", "arguments"}` object per tool. Each tool's `$defs`/`definitions` move to the
    combined schema's root, where its `#/$defs/...` refs (every nested pydantic model has
    them) still resolve once its parameters are nested under `anyOf[i]`."""
    if plan.mode == "named":
        return plan.parameters(plan.name)
    defs: dict[str, dict[str, Any]] = {}
    owners: dict[tuple[str, str], str] = {}  # (defs key, name) -> the tool that defined it
    branches = []
    for f in plan.tools:
        arguments = _hoist_defs(plan.parameters(f["name"]), f["name"], defs, owners)
        branches.append({
            "type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False})
    return {"anyOf": branches, **defs}


def _hoist_defs(params: dict[str, Any], tool: str, defs: dict[str, dict[str, Any]],
                owners: dict[tuple[str, str], str]) -> dict[str, Any]:
    """`params` without its definitions, which are added to `defs` (by key: `$defs` or
    `definitions`); a 400 when another tool defined one of the same name differently."""
    for key in _DEFS_KEYS:
        mine = params.get(key)
        if not isinstance(mine, dict):
            continue
        shared = defs.setdefault(key, {})
        for name, schema in mine.items():
            if name in shared and shared[name] != schema:
                raise InvalidRequestError(
                    f"tools {owners[key, name]!r} and {tool!r} both define {key}/{name}, "
                    "differently: with tool_choice required their parameters share one schema; "
                    "rename one of the definitions", "tools")
            shared[name] = schema
            owners.setdefault((key, name), tool)
    return {k: v for k, v in params.items() if k not in _DEFS_KEYS or not isinstance(v, dict)}


# ------------------------------------------------------------------ prompting
def template_messages(req: p.ChatCompletionRequest, plan: ToolPlan | None,
                      template: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages for the chat template, extra template kwargs): earlier tool calls and the
    tool list in the form the template understands, else as Hermes-style text."""
    knows_calls = "tool_calls" in template
    ids = _mistral_id if MISTRAL_TAG in template else None
    messages = []
    for m in req.messages:
        d = m.template_dict()
        if ids is not None and "tool_call_id" in d:
            d["tool_call_id"] = ids(d["tool_call_id"])
        if m.tool_calls:
            if knows_calls:
                d["tool_calls"] = [_template_call(c, ids) for c in m.tool_calls]
            else:
                blocks = [f"{TOOL_OPEN}\n{json.dumps(_template_call(c)['function'])}\n"
                          f"{TOOL_CLOSE}" for c in m.tool_calls]
                d["content"] = "\n".join(([d["content"]] if d["content"] else []) + blocks)
        messages.append(d)
    if plan is None or plan.mode == "none":
        return messages, {}
    if "tools" in template:
        return messages, {"tools": [{"type": "function", "function": f} for f in plan.tools]}
    listing = _SYSTEM.format(tools="\n".join(json.dumps({"type": "function", "function": f})
                                             for f in plan.tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + listing}
    else:
        messages.insert(0, {"role": "system", "content": listing})
    return messages, {}


_NINE = re.compile(r"[A-Za-z0-9]{9}")


def _mistral_id(call_id: Any) -> Any:
    """A tool call id as Mistral's templates take it, which raise on any but 9 letters and
    digits: another id becomes 9 hex digits of its hash (the same for the call and for the
    `tool` message answering it)."""
    if not isinstance(call_id, str) or _NINE.fullmatch(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _template_call(call: dict[str, Any], ids: Any = None) -> dict[str, Any]:
    """An OpenAI tool call as templates take it: arguments as an object, not JSON text (`ids`:
    how the template's ids are made from the call's)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError('a tool call is {"id": ..., "type": "function", "function": '
                                  '{"name": ..., "arguments": "{...}"}}', "messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    call_id = call.get("id")
    return {"type": "function", "id": call_id if ids is None else ids(call_id),
            "function": {"name": fn.get("name"), "arguments": args}}


# ------------------------------------------------------------------ parsing
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def split_required(text: str) -> tuple[str, str] | None:
    """(name, arguments text) of a `{"name": ..., "arguments": ...}` call: the whole call, or
    one cut short (by `max_tokens`) after its name, whose arguments are then what came;
    None before the name is complete."""
    m = _HEADER.match(text)
    if m is None:
        return None
    rest = text[m.end():].rstrip()
    if _json_object(text) is not None:  # whole: the last brace closes the wrapper
        rest = rest[:-1].rstrip()
    return json.loads(f'"{m.group(1)}"'), rest


def _auto_calls(text: str, names: set[str],
                parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """Hermes/Qwen blocks, Mistral `[TOOL_CALLS]` calls, or Llama-3 JSON calls; unparseable
    text stays content. Text with no marker is a call only when it is nothing but calls naming
    listed tools (a JSON answer the user asked for stays content): one or more Llama-3
    `{"name", "parameters"}` objects (separated by `;` or whitespace), a Mistral list of
    `{"name", "arguments"}` or `name{arguments}` (the two Mistral forms whose special marker
    tokens `skip_special_tokens` took out). The content before a call loses its trailing
    whitespace (a stream holds that back until it knows)."""
    calls: list[tuple[str, str]] = []
    head = text
    if TOOL_OPEN in text:
        head = text[: text.index(TOOL_OPEN)]
        for block in _BLOCK.findall(text):
            obj = _json_object(block)
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
        except json.JSONDecodeError:
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
        args = _json_object(args)
    if not isinstance(name, str) or not isinstance(args, dict) or (
            names is not None and name not in names):
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON text)]) of a finished choice's text."""
    if plan.mode == "named":
        return None, [(plan.name, text)]
    if plan.mode == "required":  # (constrained: the text is a call, or the start of one)
        call = split_required(text)
        return None, [call] if call else []
    if plan.mode == "auto":
        return _auto_calls(text, plan.names, plan.parallel)
    return text, []


def tool_calls(calls: list[tuple[str, str]]) -> list[p.ToolCall]:
    return [p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=n, arguments=a))
            for n, a in calls]


@dataclass
class ToolStreamer:
    """Turns one choice's streamed text into content and tool-call deltas."""

    plan: ToolPlan
    text: str = ""
    sent: int = 0  # named/required: argument characters sent; auto: content characters sent
    opened: bool = False  # the call's first delta (id, name) went out
    buffering: bool = False  # auto: a tool call began; the rest is parsed at the end
    plain: bool = False  # auto: the text does not begin with an unmarked call
    calls: list[tuple[str, str]] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[p.DeltaToolCall]]:
        """(content to send, tool-call deltas to send) after `delta`; `finished`: last one."""
        self.text += delta
        if self.plan.mode in ("named", "required"):
            return None, self._constrained(finished)
        if self.plan.mode == "auto":
            return self._auto(finished)
        return delta or None, []

    def _constrained(self, finished: bool) -> list[p.DeltaToolCall]:
        if self.plan.mode == "named":
            name, args = self.plan.name, self.text
        elif finished:
            call = split_required(self.text)
            if call is None:
                return []
            name, args = call
        else:
            m = _HEADER.match(self.text)
            if m is None:
                return []
            name = json.loads(f'"{m.group(1)}"')
            # the last character may be the wrapper's closing brace and the whitespace before
            # it may end the arguments: both wait
            args = self.text[m.end():].rstrip()[:-1].rstrip()
        out = []
        if not self.opened:
            self.opened = True
            self.calls.append((name, ""))
            out.append(p.DeltaToolCall(index=0, id=new_call_id(), type="function",
                                       function=p.DeltaFunctionCall(name=name, arguments="")))
        if len(args) > self.sent:
            out.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(
                arguments=args[self.sent:])))
            self.sent = len(args)
        return out

    def _auto(self, finished: bool) -> tuple[str | None, list[p.DeltaToolCall]]:
        text = self.text
        if not self.buffering:
            if TOOL_OPEN in text or MISTRAL_TAG in text:
                self.buffering = True
            # (a prefix decides; a cut one can only hold longer: the text is told at the end)
            elif not self.plain and not _may_begin_call(text[:4096].lstrip(), self.plan.names):
                self.plain = True  # (no unmarked call at the start: content, up to a marker)
        if not self.buffering and self.plain:
            end = len(text) if finished else _content_end(text)
            end = max(self.sent, end)
            out, self.sent = text[self.sent:end], end
            return out or None, []
        if not finished:
            return None, []
        content, calls = _auto_calls(text, self.plan.names, self.plan.parallel)
        out, self.sent = (content or "")[self.sent:], len(text)
        self.calls = calls
        deltas = [p.DeltaToolCall(index=i, id=new_call_id(), type="function",
                                  function=p.DeltaFunctionCall(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls)]
        return out or None, deltas


_WORD = re.compile(r"[A-Za-z0-9_.\-]+")


def _may_begin_call(start: str, names: set[str]) -> bool:
    """Whether an auto answer's text so far (less leading whitespace) may still begin a call
    with no `<tool_call>` or `[TOOL_CALLS]` marker before it (what `_call_sequence` takes
    with `names`): False only when it cannot, so the stream holds nothing longer than needed
    and never sends as content what the whole answer calls."""
    if any(t.startswith(start) or start.startswith(t) for t in (PYTHON_TAG, MISTRAL_TAG)):
        return True
    m = _WORD.match(start)
    if m:  # Mistral's `name{...}`
        word, rest = m.group(), start[m.end():]
        if not rest:
            return any(n.startswith(word) for n in names)
        return word in names and (rest.isspace() or rest.lstrip().startswith("{"))
    s = start[1:].lstrip() if start.startswith("[") else start
    if not s:
        return True
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


def _content_end(text: str) -> int:
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
