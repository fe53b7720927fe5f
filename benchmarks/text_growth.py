"""CPU time of growing one long answer's text a delta at a time: the engine's detokenizer (one
token a step) and the front end's tool-call reader (4-character deltas). Both keep the whole
text as a str; an append that copies it makes a long answer's appends quadratic.

    python -m benchmarks.text_growth --chars 200000 800000 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

from phaseflip.config import EMBEDDED_MODEL
from phaseflip.model.loader import load_tokenizer
from phaseflip.sampling.detokenize import IncrementalDetokenizer
from phaseflip.server.tool_parsers import AutoReader


def reader_seconds(chars: int) -> float:
    """An auto-mode answer of plain content (a tool is offered), fed 4 characters at a time."""
    reader = AutoReader(names={"get_weather"})
    reader.feed("Hello", False)
    t = time.perf_counter()
    for _ in range(chars // 4):
        reader.feed("abc ", False)
    return time.perf_counter() - t


def detokenizer_seconds(tokens: int) -> tuple[int, float]:
    """(characters, seconds) of `tokens` single-token appends with the embedded tokenizer."""
    tok = load_tokenizer(EMBEDDED_MODEL)
    ids = tok.encode("hello world " * 10)[:8]
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    t = time.perf_counter()
    for i in range(tokens):
        detok.append([ids[i % len(ids)]])
    return len(detok.text), time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, nargs="+", default=[200_000, 800_000])
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args()
    rows = []
    for chars in args.chars:
        detok_chars, detok_s = detokenizer_seconds(chars // 4)
        rows.append({"reader_chars": chars, "reader_s": round(reader_seconds(chars), 3),
                     "detok_tokens": chars // 4, "detok_chars": detok_chars,
                     "detok_s": round(detok_s, 3)})
        print(json.dumps(rows[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
