"""What a new JSON schema costs the requests already decoding (issue 20), on one engine.

`--batch` unconstrained greedy requests decode; then requests with new schemas (the nested
schema under a fresh title each, so no cache has seen it) arrive one at a time. For every
loop turn (the arrival's `add_request`, if any, plus one `EngineCore.step`) it records the wall
time, and reports per arrival: the longest turn until the constrained request has its first
token (the stall the decoding requests see) against the median turn before it, the turns it
waited, and its time to first token. The first arrival also loads xgrammar and reads the
tokenizer ("cold"); later ones only build and compile ("warm").

    python -m benchmarks.grammar_stall --device cpu --batch 8 --arrivals 7 --out stall.json
    python -m benchmarks.grammar_stall --tools 40 ...   # a 40-tool `tool_choice: required`
    python -m benchmarks.grammar_stall --device cuda --dtype bfloat16 --model llama-3.1-8b \
        --load-format dummy --batch 64 --arrivals 11   # (a bundled dummy: 4096-token tokenizer)

`--gil` instead times xgrammar on a synthetic 128 256-token vocabulary (the Llama-3 size) and
checks whether building and compiling release the GIL: the main thread's longest pause while
another thread builds (then compiles) three grammars, against their length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

SCHEMA = Path(__file__).parent / "schemas" / "nested.json"


def _schema(schema_path: Path, tools: int = 1):
    """The schema under a fresh title; with `tools` > 1, what `tool_choice: "required"` over
    that many tools taking it as parameters asks for (one of {"name", "arguments"})."""
    from phaseflip.sampling.grammar import GrammarSpec

    body = json.loads(schema_path.read_text()) | {"title": f"S{uuid.uuid4().hex[:8]}"}
    if tools > 1:
        defs = body.pop("$defs", {})
        body = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f"tool_{i}"}, "arguments": body},
            "required": ["name", "arguments"], "additionalProperties": False}
            for i in range(tools)], "$defs": defs}
    return GrammarSpec.json_schema(body)


def _prompt(i: int) -> list[int]:
    return [(13 * i + j) % 4000 + 5 for j in range(32)]


def _arrival(core, k: int, spec, decoding) -> dict:
    """One constrained arrival: its turn times until its first token."""
    from phaseflip import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=8, grammar=spec)
    before = []
    for _ in range(20):  # the steady decode turns before it
        t0 = time.perf_counter()
        core.step()
        before.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    core.add_request(f"g{k}", _prompt(100 + k), params)
    (req,) = core.groups[f"g{k}"].reqs
    turns, arrived = [], t0
    while not req.output_ids and not req.finished:
        core.step()
        turns.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
    assert all(not r.finished for r in decoding), "raise --max-new-tokens"
    median = statistics.median(before)
    return {"median_turn_ms": 1e3 * median, "max_turn_ms": 1e3 * max(turns),
            "stall_ms": 1e3 * (max(turns) - median), "turns_waited": len(turns),
            "ttft_ms": 1e3 * (time.perf_counter() - arrived)}


def run_engine(args) -> dict:
    from phaseflip import Engine, SamplingParams

    extra = {"load_format": args.load_format} if args.load_format else {}
    engine = Engine(args.model, device=args.device, dtype=args.dtype,
                    max_total_tokens=65536, overlap_schedule=False, **extra)
    core = engine.core
    plain = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    for i in range(args.batch):
        core.add_request(f"p{i}", _prompt(i), plain)
    decoding = [r for g in core.groups.values() for r in g.reqs]
    while not all(r.output_ids for r in decoding):
        core.step()
    rows = []
    for k in range(args.arrivals):
        row = _arrival(core, k, _schema(args.schema, args.tools), decoding)
        row["arrival"] = "cold" if k == 0 else "warm"
        rows.append(row)
        print(f"{row['arrival']:>4}: median turn {row['median_turn_ms']:.1f} ms, longest "
              f"while it waited {row['max_turn_ms']:.1f} ms (stall {row['stall_ms']:.1f} ms), "
              f"{row['turns_waited']} turns, TTFT {row['ttft_ms']:.0f} ms")
    for g in list(core.groups):
        core.abort(g)
    engine.shutdown()
    warm = [r["stall_ms"] for r in rows[1:]]
    if warm:
        print(f"warm stall: median {statistics.median(warm):.1f} ms, max {max(warm):.1f} ms")
    return {"batch": args.batch, "device": args.device, "schema": str(args.schema),
            "tools": args.tools, "arrivals": rows}


def _longest_pause(work) -> tuple[float, float]:
    """(work's seconds in another thread, the main thread's longest pause meanwhile)."""
    done, took = threading.Event(), []

    def run() -> None:
        t0 = time.perf_counter()
        work()
        took.append(time.perf_counter() - t0)
        done.set()

    thread, last, longest = threading.Thread(target=run), time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    return took[0], longest


def run_gil(args) -> dict:
    import random
    import string

    import xgrammar as xgr

    from phaseflip.sampling.grammar import _build

    rng, vocab = random.Random(0), [chr(i) for i in range(256)]
    seen = set(vocab)
    while len(vocab) < 128256:
        word = "".join(rng.choice(string.ascii_letters + ' "{}:,0123456789')
                       for _ in range(rng.randint(2, 9)))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler.compile_grammar(_build(_schema(args.schema, args.tools)))  # warm-up
    specs = [_schema(args.schema, args.tools) for _ in range(3)]
    build_s, build_pause_s = _longest_pause(lambda: [_build(s) for s in specs])
    grammars = [_build(s) for s in specs]
    compile_s, pause_s = _longest_pause(lambda: [compiler.compile_grammar(g) for g in grammars])
    out = {"vocab": len(vocab), "tools": args.tools, "build_ms": 1e3 * build_s / len(specs),
           "build_longest_pause_ms": 1e3 * build_pause_s,
           "compile_ms": 1e3 * compile_s / len(specs),
           "compile_longest_pause_ms": 1e3 * pause_s,
           "switch_interval_ms": 1e3 * sys.getswitchinterval()}
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default=None, help="dummy: random weights")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--arrivals", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=900)
    ap.add_argument("--schema", type=Path, default=SCHEMA)
    ap.add_argument("--tools", type=int, default=1,
                    help="a union of this many copies of the schema (tool_choice required)")
    ap.add_argument("--gil", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.model is None:
        import phaseflip

        args.model = str(Path(phaseflip.__file__).parent / "assets" / "tiny-llama")
    result = run_gil(args) if args.gil else run_engine(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
