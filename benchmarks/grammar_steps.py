"""Where a constrained step's host time goes (issue 20, the ITL p99 of one-wave runs).

One wave of `--requests` requests (all added at once, as `bench_serving --num-prompts N
--max-concurrency N` sends them) runs to its end on one engine, without a grammar and then
with `--schema`; every loop turn (`EngineCore.step`) is timed, and inside it the host phases:
schedule, forward, the grammar masks (matchers brought up to date and filled), sampling
(the mask's apply included), taking an overlapped step's tokens, making text and outputs.
Adding the wave (a matcher per constrained request) is timed apart. `--null-forward` swaps
the model for rows of a fixed random logits matrix, so a step's time is its host work alone.

    python -m benchmarks.grammar_steps --null-forward --requests 64 --prompt-len 512 \
        --out steps.json [--profile prof.txt]
    python -m benchmarks.grammar_steps --device cuda --dtype bfloat16 --model llama-3.1-8b \
        --load-format dummy --requests 64 --prompt-len 512   # the H200 one-wave shape

Reported per run: turns, their p50/p99/max wall ms (and of decode-only turns), the turns over
3x the median with what they held (prefill tokens, finishes), and each phase's total and
largest single share. On a GPU a turn waits for the device only in `take_tokens` (the previous
step's tokens): `decode_host_busy` (a decode turn's wall time less that wait) is the host's own
work, and a step is host-bound when it nears the turn's wall time.

`--split RESULT.json` reads a `bench_serving --compare-unconstrained` result instead and
splits each run's ITLs at the wave's last first token: the gaps that began while prompts were
still being prefilled (a decoding request waits out a 8192-token prefill step: 40-190 ms on
the H200) against the decode-only rest. A one-wave run pools the two, and its p99 rank is
1 % of the tokens: the constrained answers are half as long, so the same hundred-odd prefill
waits that sit above the unconstrained p99 rank reach into the constrained one.

    python -m benchmarks.grammar_steps --split structured_wave.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.common import adds_seconds, itl_split, wrap_method
from benchmarks.common import pct_ms as _pct

SCHEMA = Path(__file__).parent / "schemas" / "nested.json"
PHASES = (("scheduler", "schedule"), ("runner", "forward"), ("grammars", "masks"),
          ("sampler", "sample_on_device"), ("sampler", "sample"), ("outputs", "take_tokens"),
          ("outputs", "emit_text"), ("outputs", "process"))


def _timed(obj, name: str, clock: dict) -> None:
    """Wraps `obj.name` so each call's seconds add to clock[name] (this turn's)."""
    wrap_method(obj, name, lambda: adds_seconds(clock, name))


def _owners(core) -> dict:
    return {"scheduler": core.scheduler, "runner": core.runner,
            "grammars": core.sampling.grammars, "sampler": core.sampling.sampler,
            "outputs": core.outputs}


def run_wave(args, spec) -> dict:
    """One wave to its end: per-turn wall and phase times."""
    from benchmarks.bench_scheduler import install_null_forward
    from phaseflip import Engine, SamplingParams

    extra = {"load_format": args.load_format} if args.load_format else {}
    engine = Engine(args.model, device=args.device, dtype=args.dtype,
                    max_total_tokens=args.requests * (args.prompt_len + args.max_new + 64),
                    max_running_requests=args.requests, **extra)
    core = engine.core
    vocab = core.model_cfg.vocab_size
    if args.null_forward:
        install_null_forward(core, args.requests * args.prompt_len, vocab, 0)
    if spec is not None:  # compiled before the wave, as bench_serving's warm-up request does
        core.sampling.grammars.compiled(spec)
    clock: dict[str, float] = defaultdict(float)
    for owner, name in PHASES:
        _timed(_owners(core)[owner], name, clock)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new,
                            grammar=spec, ignore_eos=spec is None)
    t0 = time.perf_counter()
    for i in range(args.requests):
        prompt = [(7 * i + 13 * j) % (min(vocab, 4096) - 8) + 4 for j in range(args.prompt_len)]
        core.add_request(f"r{i}", prompt, params)
    add_ms = 1e3 * (time.perf_counter() - t0)
    reqs = [r for g in core.groups.values() for r in g.reqs]
    turns, stats = [], core.scheduler.stats
    prof = cProfile.Profile() if args.profile and spec is not None else None
    while core.has_work():
        clock.clear()
        pre, done = stats.prefill_tokens, sum(r.finished for r in reqs)
        if prof:
            prof.enable()
        t = time.perf_counter()
        core.step()
        wall = time.perf_counter() - t
        if prof:
            prof.disable()
        turns.append({"wall_ms": 1e3 * wall, "prefill": stats.prefill_tokens - pre,
                      "finished": sum(r.finished for r in reqs) - done,
                      **{k: 1e3 * v for k, v in clock.items()}})
    lens = [len(r.output_ids) for r in reqs]
    engine.shutdown()
    return {"add_wave_ms": add_ms, "turns": turns, "mean_output": statistics.mean(lens),
            "profile": _profile_text(prof) if prof else None}


def _profile_text(prof: cProfile.Profile) -> str:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(40)
    return out.getvalue()


def summarise(name: str, run: dict) -> dict:
    walls = sorted(t["wall_ms"] for t in run["turns"])
    q = lambda p: walls[min(len(walls) - 1, int(p * len(walls)))]  # noqa: E731
    med = statistics.median(walls)
    slow = [dict(i=i, **{k: round(v, 2) for k, v in t.items()})
            for i, t in enumerate(run["turns"]) if t["wall_ms"] > 3 * med]
    phases: dict[str, list[float]] = defaultdict(list)
    for t in run["turns"]:
        for k, v in t.items():
            if k not in ("wall_ms", "prefill", "finished"):
                phases[k].append(v)
    decode = [t for t in run["turns"] if t["prefill"] == 0]
    # the host's own time: a turn waits for the device only for the previous step's tokens
    busy = [t["wall_ms"] - t.get("take_tokens", 0.0) for t in decode]
    out = {"run": name, "add_wave_ms": round(run["add_wave_ms"], 1), "turns": len(walls),
           "mean_output_tokens": round(run["mean_output"], 1), "p50_ms": round(med, 3),
           "p99_ms": round(q(0.99), 3), "max_ms": round(walls[-1], 3),
           "decode_turns": len(decode),
           "decode_p50_ms": _pct([t["wall_ms"] / 1e3 for t in decode], 0.5),
           "decode_p99_ms": _pct([t["wall_ms"] / 1e3 for t in decode], 0.99),
           "decode_host_busy_p50_ms": _pct([b / 1e3 for b in busy], 0.5),
           "decode_host_busy_p99_ms": _pct([b / 1e3 for b in busy], 0.99),
           "phases_ms": {k: {"total": round(sum(v), 1), "max": round(max(v), 3),
                             "p50": round(statistics.median(v), 3)} for k, v in phases.items()},
           "slow_turns": slow[:20]}
    print(json.dumps({k: v for k, v in out.items() if k != "slow_turns"}, indent=1))
    for s in slow[:20]:
        print("  slow turn", s)
    return out


def split_main(path: Path) -> dict:
    """The ITL split of each run that was one wave (every request sent at once, no concurrency
    limit below the prompt count): under spread arrivals prompts keep prefilling past any cut,
    so the "decode-only" gaps would not be that."""
    result = json.loads(path.read_text())
    out = {}
    for name in ("unconstrained", "constrained"):
        run = result[name]
        limit = run.get("max_concurrency")
        if run.get("request_rate") == "inf" and (not limit or limit >= run["num_prompts"]):
            out[name] = itl_split(run)
        else:
            print(f"{name}: not one wave (request_rate {run.get('request_rate')}, "
                  f"max_concurrency {limit}): no split")
    print(json.dumps(out, indent=1))
    return out


def main() -> None:
    from phaseflip.sampling.grammar import GrammarSpec

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the embedded tiny one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default=None, help="dummy: random weights")
    ap.add_argument("--null-forward", action="store_true", help="no model math (host only)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--schema", type=Path, default=SCHEMA)
    ap.add_argument("--profile", type=Path, help="cProfile of the constrained run's steps")
    ap.add_argument("--split", type=Path, help="a bench_serving comparison's JSON: ITL split")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.split:
        split_main(args.split)
        return
    if args.model is None:
        import phaseflip

        args.model = str(Path(phaseflip.__file__).parent / "assets" / "tiny-llama")
    spec = GrammarSpec.json_schema(json.loads(args.schema.read_text()))
    result = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name, s in (("unconstrained", None), ("constrained", spec)):
        run = run_wave(args, s)
        gc.collect()  # the first engine's device memory back before the second starts
        if args.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
        result[name] = summarise(name, run)
        if run["profile"] and args.profile:
            args.profile.write_text(run["profile"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
