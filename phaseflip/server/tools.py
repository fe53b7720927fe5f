"""Tool calls on `/v1/chat/completions`: which mode, what the model is shown, what it must
generate, and how its text becomes `tool_calls` (whole, or as stream deltas).

Modes (`tool_choice`): "none" (tools are not shown), "auto" (shown; the text is parsed for the
formats of `tool_parsers`: Hermes/Qwen `<tool_call>` blocks, Mistral `[TOOL_CALLS]` calls,
Llama-3 JSON calls, Llama 3.2's pythonic `[f(x=1)]`; text with no marker is a call only when
it begins with a call naming a listed tool, a pythonic list only when it is all calls),
"required" (the output is constrained to one `{"name": ..., "arguments": {...}}` object
naming a listed tool) and a named function (the output is constrained to that tool's
arguments object). The two constrained modes always parse. A chat template that knows tools
gets them (`tools=`); any other gets a Hermes-style system prompt listing them.

Arguments are the generated JSON text itself, so a streamed call's argument fragments
concatenate to exactly the arguments of the same call answered whole. Under "auto" a stream
names a call once it is certain and sends its arguments as they come (`AutoReader`); Llama
3.2's pythonic calls, one expression read at its end, come whole at the end.
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
from phaseflip.server.token_text import SpecialStripper, TokenText
from phaseflip.server.tool_parsers import (
    ARGS_TAG,
    HEADER,
    MISTRAL_TAG,
    PARSER_MARKERS,
    TOOL_CLOSE,
    TOOL_OPEN,
    AutoReader,
    auto_calls,
    json_object,
    split_required,
)

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
    # set when the text keeps the special tokens the request asked skipped (`keep_specials`)
    specials: TokenText | None = None

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.tools}

    def parameters(self, name: str) -> dict[str, Any]:
        fn = next(f for f in self.tools if f["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def finish_reason(self, reason: str | None, called: bool, text: str) -> str | None:
        """An answer that called tools and ended by itself finishes with "tool_calls", except
        under a named tool_choice, where OpenAI (and vLLM after it) says "stop": clients
        that branch on the reason see what they would from OpenAI. A call cut short by a user
        stop string (its arguments not whole, the `text` of required not a whole call) says
        "stop": a client told "tool_calls" would run arguments that are not whole."""
        if self.mode == "named" or reason != "stop" or not called:
            return reason
        if self.mode == "auto":
            whole = auto_calls(text, self.names, self.parallel)[2]
        else:
            whole = json_object(text) is not None
        return "tool_calls" if whole else reason

    def stripper(self) -> SpecialStripper | None:
        """One choice's text as the parser reads it: with `specials`, less the special tokens
        but the parser's markers (the engine decodes with all or none), so it is what
        `skip_special_tokens` gives plus the markers; None: the text as it comes."""
        return None if self.specials is None else SpecialStripper(self.specials, PARSER_MARKERS)

    @property
    def content_tags(self) -> tuple[str, ...]:
        """What streamed content holds back the start of: a call's marker, and with
        `specials` every marker `shown` takes out (one split over deltas stays whole)."""
        return (TOOL_OPEN, MISTRAL_TAG, *((ARGS_TAG,) if self.specials else ()))

    def shown(self, content: str | None) -> str | None:
        """`content` as the request asked for it: with `specials`, without the markers that
        were kept for the parser only (text with a marker but no call is content)."""
        if content is None or self.specials is None:
            return content
        for marker in PARSER_MARKERS:
            content = content.replace(marker, "")
        return content


def keep_specials(plan: ToolPlan | None, token_text: TokenText) -> bool:
    """Whether an `auto` request is to be decoded with its special tokens (the caller's
    `skip_special_tokens` asked them skipped): where Mistral's `[TOOL_CALLS]` is one, skipped
    it turned `Sure. [TOOL_CALLS][{"name": ...}]` into `Sure. [{"name": ...}]`, content,
    since only text that is nothing but calls is a call without a marker (vLLM keeps them
    too). The plan (its `specials` set) then reads the text without the others and sends
    content without the markers (`stripper`, `shown`)."""
    if plan is None or plan.mode != "auto":
        return False
    marker = token_text.tokenizer.convert_tokens_to_ids(MISTRAL_TAG)  # (else unk, or None)
    return marker in token_text.special and token_text.spell(marker) == MISTRAL_TAG


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
        except ValueError:  # (not JSON, or an int past Python's 4 300-digit limit)
            pass
    call_id = call.get("id")
    return {"type": "function", "id": call_id if ids is None else ids(call_id),
            "function": {"name": fn.get("name"), "arguments": args}}


# ------------------------------------------------------------------ parsing
def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(plan: ToolPlan, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON text)]) of a finished choice's text."""
    if plan.mode == "named":
        return None, [(plan.name, text)]
    if plan.mode == "required":  # (constrained: the text is a call, or the start of one)
        call = split_required(text)
        return None, [call] if call else []
    if plan.mode == "auto":
        content, calls, _ = auto_calls(text, plan.names, plan.parallel)
        content = plan.shown(content)
        return (content or None) if calls else content, calls
    return text, []


def tool_calls(calls: list[tuple[str, str]]) -> list[p.ToolCall]:
    return [p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=n, arguments=a))
            for n, a in calls]


@dataclass
class ToolStreamer:
    """Turns one choice's streamed text into content and tool-call deltas: a call's first delta
    names it (`index`, `id`, `type`, `function.name`, the arguments so far), the next ones
    carry `index` and the fragments of its arguments as they come (`AutoReader` tells when
    a call is certain; pythonic calls come whole at the end)."""

    plan: ToolPlan
    own_text: str = ""  # the text so far, where no `AutoReader` keeps it
    sent: int = 0  # named/required: argument characters sent
    opened: bool = False  # the call's first delta (id, name) went out
    calls: list = field(default_factory=list)  # [name, arguments so far, ...] per call
    reader: AutoReader | None = None
    # required: the call's name and where its arguments begin, once certain; where the text's
    # trailing whitespace begins; the last (end, end less its whitespace) of the arguments
    # but their last character. Each delta costs what it brings (the arguments were copied
    # and stripped whole at each delta: 2-3 s over a 200 000-character call, 4 a delta).
    head: tuple[str, int] | None = None
    tail_ws: int = 0
    last_end: tuple[int, int] = (-1, -1)

    def __post_init__(self) -> None:
        if self.plan.mode == "auto":
            self.reader = AutoReader(self.plan.names, self.plan.parallel, self.plan.content_tags)
            self.calls = self.reader.calls

    @property
    def text(self) -> str:
        """The choice's text so far (the reader's, in `auto` mode: one copy, not two)."""
        return self.reader.text if self.reader is not None else self.own_text

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[p.DeltaToolCall]]:
        """(content to send, tool-call deltas to send) after `delta`; `finished`: last one."""
        if self.reader is None:
            if delta.strip():
                self.tail_ws = len(self.own_text) + len(delta.rstrip())
            text, self.own_text = self.own_text, ""  # grown in place (as AutoReader.feed)
            text += delta
            self.own_text = text
        if self.plan.mode in ("named", "required"):
            return None, self._constrained(finished)
        if self.reader is not None:
            content, events = self.reader.feed(delta, finished)
            return self.plan.shown(content) or None, _call_deltas(events)
        return delta or None, []

    def _constrained(self, finished: bool) -> list[p.DeltaToolCall]:
        text, start = self.own_text, 0  # the arguments: text[start:end]
        if self.plan.mode == "named":
            name, end = self.plan.name, len(text)
        elif finished:
            call = split_required(text)
            if call is None:
                return []
            name, text = call  # (the arguments alone: start 0)
            end = len(text)
        else:
            if self.head is None:
                m = HEADER.match(text)
                if m is None or m.end() == len(text):  # (whitespace may still come)
                    return []
                self.head = json.loads(f'"{m.group(1)}"'), m.end()
            name, start = self.head
            end = self._settled()
        out = []
        if not self.opened:
            self.opened = True
            self.calls.append((name, ""))
            out.append(p.DeltaToolCall(index=0, id=new_call_id(), type="function",
                                       function=p.DeltaFunctionCall(name=name, arguments="")))
        if end - start > self.sent:
            out.append(p.DeltaToolCall(index=0, function=p.DeltaFunctionCall(
                arguments=text[start + self.sent:end])))
            self.sent = end - start
        return out

    def _settled(self) -> int:
        """Where the required call's arguments that may be sent end: the last character may be
        the wrapper's closing brace and the whitespace before it may end the arguments, so
        both wait (`text[start:].rstrip()[:-1].rstrip()`, reading only what is not yet sent)."""
        start, text = self.head[1], self.own_text
        end = max(self.tail_ws, start) - 1
        if end <= start + self.sent:
            return start + self.sent
        if end != self.last_end[0]:
            j = end
            while j > start + self.sent and text[j - 1].isspace():
                j -= 1
            self.last_end = end, j
        return self.last_end[1]


def _call_deltas(events: list[tuple[int, str | None, str]]) -> list[p.DeltaToolCall]:
    """`AutoReader` events as deltas: one opening each call (with a new id), the argument
    pieces that follow it in the same feed joined to the delta before them."""
    out: list[p.DeltaToolCall] = []
    for index, name, piece in events:
        if name is not None:
            out.append(p.DeltaToolCall(index=index, id=new_call_id(), type="function",
                                       function=p.DeltaFunctionCall(name=name, arguments=piece)))
        elif out and out[-1].index == index:
            out[-1].function.arguments += piece
        elif piece:
            out.append(p.DeltaToolCall(index=index, function=p.DeltaFunctionCall(
                arguments=piece)))
    return out
