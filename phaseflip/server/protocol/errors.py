"""Pydantic/FastAPI validation errors → one OpenAI-style message naming the field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import (
    ValidationError,
)

from phaseflip.server.protocol.requests import (
    _CUSTOM_ERROR,
)

# ---------------------------------------------------------------------------------------------
# Validation errors -> one OpenAI-style message
# ---------------------------------------------------------------------------------------------

_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})
_BARE_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes", "list", "dict"})


def _is_union_tag(part: str | int) -> bool:
    """Pydantic puts the union member it tried into `loc` ('list[int]', 'str',
    'function-after[...]', a model's class name); those are noise in a field path. Field names
    here are snake_case, so they never look like these."""
    if not isinstance(part, str):
        return False
    return ("[" in part or "-" in part or part in _BARE_TYPE_TAGS
            or (part[:1].isupper() and part.isidentifier()))


def _describe(err: Mapping[str, Any], from_fastapi: bool) -> tuple[list[str], str, bool]:
    """(field path, message, whether it is one failed alternative of a union) for one error."""
    loc = list(err.get("loc", ()))
    if from_fastapi and loc and loc[0] in _REQUEST_PARTS:
        loc = loc[1:]
    ctx = err.get("ctx") or {}
    kind = err.get("type", "")
    msg = str(err.get("msg", "invalid value"))
    union_member = bool(loc) and _is_union_tag(loc[-1])
    parts = [str(p) for p in loc if not _is_union_tag(p)]
    if kind == "json_invalid":
        return [], f"invalid JSON body: {ctx.get('error', msg)}", False
    if kind == _CUSTOM_ERROR:
        msg = str(ctx.get("message", msg))
        if ctx.get("field"):
            parts.append(str(ctx["field"]))
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if kind == "extra_forbidden":
        msg = "Unrecognized request argument supplied: " + ".".join(parts)
    return parts, msg, union_member


def validation_error_to_openai(
    exc: ValidationError | Sequence[Mapping[str, Any]],
) -> tuple[str, str | None]:
    """(message, param) for a pydantic `ValidationError` or FastAPI's
    `RequestValidationError.errors()` (whose locations start with "body").

    Every distinct problem is listed, each as "field.path: what is wrong"; `param` is the path
    of the first. Errors raised by our own cross-field checks carry their field in `ctx`.
    Where a union failed, pydantic reports one error per alternative: an alternative that got
    deeper into the value is the informative one, so shallow mismatches are dropped, and
    alternatives failing at the same place are merged ("... or ...").
    """
    from_fastapi = not isinstance(exc, ValidationError)
    errors = exc.errors(include_url=False) if isinstance(exc, ValidationError) else list(exc)
    described = [_describe(err, from_fastapi) for err in errors]
    paths = [tuple(parts) for parts, _, _ in described]
    merged: dict[tuple[str, ...], list[str]] = {}
    for (_, msg, union_member), path in zip(described, paths):
        if union_member and any(len(o) > len(path) and o[: len(path)] == path for o in paths):
            continue
        bucket = merged.setdefault(path, [])
        if msg not in bucket:
            bucket.append(msg)
    messages = []
    for path, msgs in merged.items():
        text = " or ".join(msgs)
        if not text.startswith(("Unrecognized request argument", "invalid JSON body")):
            text = f"{'.'.join(path) or 'request body'}: {text}"
        messages.append(text)
    param = next((".".join(p) for p in merged if p), None)
    return "; ".join(messages) or "invalid request", param
