"""The tiny model's training corpus: the docstrings and comments of the Python standard library.

Every Python installation has this text, so `train_tiny_model.py` needs no download. Documents
come in sorted file order (deterministic); a stable hash of each picks whether it is written as
plain text or as a one-turn ChatML exchange (`to_training_text`).
"""

from __future__ import annotations

import ast
import hashlib
import io
import os
import re
import sysconfig
import tokenize
from pathlib import Path

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}
MIN_DOC_CHARS = 24


def _clean(text: str) -> str:
    text = text.expandtabs(4).replace("\r\n", "\n").replace("\r", "\n")
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = "\n".join(lines).strip()
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text


_PUNCT_ONLY = re.compile(r"^[\W_]*$")


def _comment_blocks(source: str) -> list[tuple[int, str]]:
    """Groups of comment lines on consecutive source lines -> (first line, text)."""
    blocks: list[tuple[int, str]] = []
    cur: list[str] = []
    start = last = -10
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return blocks
    for tok in toks:
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        body = tok.string[1:]
        if body.startswith(" "):
            body = body[1:]
        if row <= 2 and (body.startswith("!") or "coding" in body):
            continue  # shebang / encoding cookie
        if _PUNCT_ONLY.match(body):
            body = ""  # ruler lines like '#######'
        if row != last + 1 and cur:
            blocks.append((start, "\n".join(cur)))
            cur = []
        if not cur:
            start = row
        cur.append(body)
        last = row
    if cur:
        blocks.append((start, "\n".join(cur)))
    return blocks


def _docstrings(tree: ast.AST, modname: str) -> list[tuple[int, str, str | None]]:
    """(line, docstring, qualified name or None for modules)."""
    out: list[tuple[int, str, str | None]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qual = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc:
                    out.append((child.lineno, doc, qual))
                visit(child, qual)

    doc = ast.get_docstring(tree, clean=True)  # type: ignore[arg-type]
    if doc:
        out.append((1, doc, None))
    visit(tree, modname)
    return out


def iter_stdlib_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py"):
                yield Path(dirpath) / fn


def build_corpus(max_chars: int) -> tuple[list[dict], dict]:
    """All documents in deterministic order, each {'text', 'kind', 'name', 'file'}."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[dict] = []
    seen: set[str] = set()
    total = 0
    n_files = 0
    for path in iter_stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            with tokenize.open(path) as fh:
                source = fh.read()
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        n_files += 1
        modname = rel[:-3].replace("/", ".").removesuffix(".__init__")
        items: list[tuple[int, str, str, str | None]] = []
        for line, text, qual in _docstrings(tree, modname):
            items.append((line, "docstring", text, qual))
        for line, text in _comment_blocks(source):
            items.append((line, "comment", text, None))
        items.sort(key=lambda t: (t[0], t[1]))
        for _, kind, text, qual in items:
            text = _clean(text)
            if len(text) < MIN_DOC_CHARS or text in seen:
                continue
            seen.add(text)
            docs.append({"text": text, "kind": kind, "name": qual, "file": rel})
            total += len(text)
        if total >= max_chars:
            break
    meta = {
        "stdlib_root": str(root),
        "files_parsed": n_files,
        "documents": len(docs),
        "chars": total,
        "last_file": docs[-1]["file"] if docs else None,
    }
    return docs, meta


def _stable_frac(s: str) -> float:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def to_training_text(doc: dict, chat_frac: float) -> str:
    """Plain text, or (for a deterministic fraction of named docstrings) a ChatML turn,
    so the model also learns to answer after ``<|im_start|>assistant`` and to stop
    with ``<|im_end|>``."""
    name = doc["name"]
    if doc["kind"] == "docstring" and name and _stable_frac(doc["text"]) < chat_frac:
        short = name.split(".", 1)[-1] if name.count(".") > 1 else name
        return (
            f"{IM_START}user\nWhat does {short} do?{IM_END}\n"
            f"{IM_START}assistant\n{doc['text']}{IM_END}\n"
        )
    return doc["text"]
