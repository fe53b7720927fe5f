"""Tool calls on `/v1/chat/completions`: which mode, what the model is shown, what it must
generate, and how its text becomes `tool_calls` (whole, or as stream deltas).

Modes (`tool_choice`): "none" (tools are not shown), "auto" (shown; the text is parsed for
Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks or a Llama-3 JSON call
`{"name", "parameters"}`), "required" (the output is constrained to one
`{"name": ..., "arguments": {...}}` object naming a listed tool) and a named function (the
output is constrained to that tool's arguments object). The two constrained modes always
parse. A chat template that knows tools gets them (`tools=`); any other gets a Hermes-style
system prompt listing them.

Arguments are the generated JSON text itself, so a streamed call's argument fragments
concatenate to exactly the arguments of the same call answered whole.
"""

from __future__ import annotations

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
    messages = []
    for m in req.messages:
        d = m.template_dict()
        if m.tool_calls:
            if knows_calls:
                d["tool_calls"] = [_template_call(c) for c in m.tool_calls]
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


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as templates take it: arguments as an object, not JSON text."""
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
    return {"type": "function", "id": call.get("id"),
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


def _auto_calls(text: str, parallel: bool = True) -> tuple[str | None, list[tuple[str, str]]]:
    """Hermes/Qwen blocks, or a Llama-3 JSON call; unparseable text stays content. The content
    before a call loses its trailing whitespace (a stream holds that back until it knows)."""
    calls: list[tuple[str, str]] = []
    head = text
    if TOOL_OPEN in text:
        head = text[: text.index(TOOL_OPEN)]
        for block in _BLOCK.findall(text):
            obj = _json_object(block)
            if obj is not None and isinstance(obj.get("name"), str):
                calls.append((obj["name"], json.dumps(obj.get("arguments", {}),
                                                      ensure_ascii=False)))
    else:
        body = text.strip()
        body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
        obj = _json_object(body) if body.startswith("{") else None
        args = None if obj is None else obj.get("parameters", obj.get("arguments"))
        if obj is not None and isinstance(obj.get("name"), str) and isinstance(args, dict):
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
            head = ""
    if not calls:
        return text, []
    return (head.rstrip() if head.strip() else None), calls if parallel else calls[:1]


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
        return _auto_calls(text, plan.parallel)
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
            start = text.lstrip()
            if TOOL_OPEN in text or start.startswith(("{", PYTHON_TAG)):
                self.buffering = True
        if not self.buffering:
            end = len(text) if finished else _content_end(text)
            end = max(self.sent, end)
            out, self.sent = text[self.sent:end], end
            return out or None, []
        if not finished:
            return None, []
        content, calls = _auto_calls(text, self.plan.parallel)
        if not calls:  # not a call after all: the held text is content
            out, self.sent = text[self.sent:], len(text)
            return out or None, []
        self.calls = calls
        deltas = [p.DeltaToolCall(index=i, id=new_call_id(), type="function",
                                  function=p.DeltaFunctionCall(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls)]
        rest = text[self.sent: text.index(TOOL_OPEN)] if TOOL_OPEN in text else ""
        return rest.rstrip() or None, deltas


def _content_end(text: str) -> int:
    """How much of an unfinished auto answer's `text` is content for sure: all but a suffix
    that may begin a `<tool_call>` and the whitespace before it (content before a call ends
    without it). Nothing while the text may still begin a Llama-3 call (all whitespace, or a
    beginning of `<|python_tag|>`)."""
    if PYTHON_TAG.startswith(text.lstrip()):  # (a Llama-3 call may begin so)
        return 0
    hold = 0
    for k in range(min(len(TOOL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_OPEN.startswith(text[-k:]):
            hold = k
            break
    return len(text[: len(text) - hold].rstrip())
