"""A small JSON-schema checker for the structured-output benchmark (no `jsonschema` dependency).

It covers the keywords grammar-constrained JSON usually meets: type, enum, const, properties,
required, additionalProperties, items, min/maxItems, min/maxLength, pattern, minimum/maximum
(and the exclusive ones), anyOf/oneOf/allOf and local `$ref`s (`#/$defs/...`). A keyword it
does not know is not silently passed: `unchecked_keywords` names it, and the benchmark reports
it next to the count of valid outputs (an unchecked constraint is unmeasured, not satisfied).
"""

from __future__ import annotations

import re
from typing import Any

# Keywords that constrain nothing (annotations) or that the walk below handles.
_ANNOTATIONS = {"$schema", "$id", "$comment", "title", "description", "default", "examples",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly"}
_CHECKED = {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
            "minItems", "maxItems", "minLength", "maxLength", "pattern", "minimum", "maximum",
            "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf", "allOf", "$ref"}
_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def unchecked_keywords(schema: Any) -> list[str]:
    """Keywords anywhere in `schema` that `problems` does not check (sorted)."""
    found: set[str] = set()

    def walk(node: Any, in_map: bool = False) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for key, value in node.items():
                if in_map:  # the keys of properties/$defs are names, not keywords
                    walk(value)
                    continue
                if key not in _ANNOTATIONS | _CHECKED:
                    found.add(key)
                if key in ("enum", "const", "default", "examples"):
                    continue  # values, not schemas
                walk(value, in_map=key in ("properties", "$defs", "definitions"))

    walk(schema)
    return sorted(found)


def problems(value: Any, schema: Any, root: Any = None, at: str = "$") -> list[str]:
    """Where `value` breaks `schema`, as 'path: what' lines (empty: it validates)."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return []
    if schema is False:
        return [f"{at}: no value is allowed here"]
    if "$ref" in schema:
        return problems(value, _resolve(root, schema["$ref"]), root, at)
    out = _check_type(value, schema, at)
    if out:
        return out  # the other keywords assume the type
    if "enum" in schema and not any(_same(value, x) for x in schema["enum"]):
        out.append(f"{at}: {value!r} is not one of {schema['enum']!r}")
    if "const" in schema and not _same(value, schema["const"]):
        out.append(f"{at}: {value!r} is not {schema['const']!r}")
    if isinstance(value, dict):
        out += _check_object(value, schema, root, at)
    elif isinstance(value, list):
        out += _check_array(value, schema, root, at)
    elif isinstance(value, str):
        out += _check_string(value, schema, at)
    elif not isinstance(value, bool) and isinstance(value, int | float):
        out += _check_number(value, schema, at)
    out += _check_combinators(value, schema, root, at)
    return out


def _same(a: Any, b: Any) -> bool:
    """JSON equality: True is not 1, 1 is 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _resolve(root: Any, ref: str) -> Any:
    if not ref.startswith("#"):
        raise ValueError(f"only local $refs are supported, got {ref!r}")
    node = root
    for part in filter(None, ref[1:].split("/")):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _check_type(value: Any, schema: dict[str, Any], at: str) -> list[str]:
    want = schema.get("type")
    if want is None:
        return []
    names = want if isinstance(want, list) else [want]
    if any(_TYPES[n](value) for n in names):
        return []
    return [f"{at}: {type(value).__name__} {value!r:.40} is not of type {want}"]


def _check_object(value: dict, schema: dict[str, Any], root: Any, at: str) -> list[str]:
    out = [f"{at}: missing required {k!r}" for k in schema.get("required", ()) if k not in value]
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in props:
            out += problems(item, props[key], root, f"{at}.{key}")
        elif extra is False:
            out.append(f"{at}: unexpected property {key!r}")
        elif isinstance(extra, dict):
            out += problems(item, extra, root, f"{at}.{key}")
    return out


def _check_array(value: list, schema: dict[str, Any], root: Any, at: str) -> list[str]:
    out = []
    if len(value) < schema.get("minItems", 0):
        out.append(f"{at}: {len(value)} items, fewer than minItems {schema['minItems']}")
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        out.append(f"{at}: {len(value)} items, more than maxItems {schema['maxItems']}")
    if isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            out += problems(item, schema["items"], root, f"{at}[{i}]")
    return out


def _check_string(value: str, schema: dict[str, Any], at: str) -> list[str]:
    out = []
    if len(value) < schema.get("minLength", 0):
        out.append(f"{at}: length {len(value)} < minLength {schema['minLength']}")
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        out.append(f"{at}: length {len(value)} > maxLength {schema['maxLength']}")
    if "pattern" in schema and re.search(schema["pattern"], value) is None:
        out.append(f"{at}: {value!r:.40} does not match {schema['pattern']!r}")
    return out


def _check_number(value: float, schema: dict[str, Any], at: str) -> list[str]:
    bounds = (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
              ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b))
    return [f"{at}: {value} breaks {name} {schema[name]}" for name, ok in bounds
            if name in schema and not ok(schema[name])]


def _check_combinators(value: Any, schema: dict[str, Any], root: Any, at: str) -> list[str]:
    out = []
    for sub in schema.get("allOf", ()):
        out += problems(value, sub, root, at)
    if "anyOf" in schema and all(problems(value, s, root, at) for s in schema["anyOf"]):
        out.append(f"{at}: matches none of anyOf")
    if "oneOf" in schema:
        matches = sum(not problems(value, s, root, at) for s in schema["oneOf"])
        if matches != 1:
            out.append(f"{at}: matches {matches} of oneOf, not exactly one")
    return out
