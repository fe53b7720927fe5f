"""A mixed workload that looks like agent fleets (issue 17): the traffic a phase flip is for.

Bursts of long prompts sharing long prefixes (a fleet of agents starting on one system prompt or
document) over a steady background of short-prompt decode traffic (chat turns, tool calls).
Seeded and deterministic: the same `WorkloadSpec` gives the same token ids and arrival times,
so the real-server benchmark (`benchmarks/bench_flip_workload.py`) and the simulator
(`flip/sim.py`) replay one trace. Arrivals are Poisson (background gaps exponential; burst
starts exponential around `burst_every_s`, or evenly spaced with `alternate`), or a trace:
`save_trace` / `load_trace` write and read the arrivals as JSON.

The `prefill_share` of a trace is its prompt tokens over all its tokens (prompt + output): the
x axis of the flip map (`benchmarks/flip_map.py`).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate; token counts are per request, times in seconds. The defaults are the
    CPU scale of the benchmark (the embedded tiny model, 1024 positions)."""

    duration_s: float = 40.0
    seed: int = 0
    vocab_size: int = 4096  # ids are drawn from [1, vocab_size) (0 is often EOS)
    # background: short prompts that mostly decode
    background_rps: float = 3.0
    background_prompt_tokens: int = 24
    background_output_tokens: int = 48
    # bursts: a fleet of long prompts on one shared prefix
    burst_every_s: float = 8.0  # mean gap between burst starts
    burst_requests: int = 16
    burst_prefix_tokens: int = 384  # shared by every request of a burst
    burst_suffix_tokens: int = 384  # unique to each request
    burst_output_tokens: int = 8
    burst_spread_s: float = 0.3  # a burst's requests arrive within this window
    prefixes: int = 2  # distinct shared prefixes; bursts cycle through them
    alternate: bool = False  # bursts exactly every burst_every_s (no jitter)

    def scaled(self, **over: Any) -> WorkloadSpec:
        return replace(self, **over)


@dataclass(frozen=True)
class Arrival:
    """One request of the trace."""

    t_s: float
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    kind: str  # "burst" or "background"
    group: int  # the burst's index (-1: background)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"prompt_ids": list(self.prompt_ids)}


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, vocab) for _ in range(n))


def _burst_starts(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    starts, t = [], spec.burst_every_s / 2 if spec.alternate else 0.0
    while True:
        t += spec.burst_every_s if spec.alternate else rng.expovariate(1 / spec.burst_every_s)
        if t >= spec.duration_s:
            return starts
        starts.append(t)


def generate(spec: WorkloadSpec) -> list[Arrival]:
    """The trace of `spec`, sorted by arrival time."""
    rng = random.Random(spec.seed)
    prefixes = [_ids(rng, spec.burst_prefix_tokens, spec.vocab_size)
                for _ in range(max(1, spec.prefixes))]
    out: list[Arrival] = []
    for g, start in enumerate(_burst_starts(spec, rng)):
        prefix = prefixes[g % len(prefixes)]
        for _ in range(spec.burst_requests):
            t = start + rng.uniform(0.0, spec.burst_spread_s)
            out.append(Arrival(t, prefix + _ids(rng, spec.burst_suffix_tokens, spec.vocab_size),
                               spec.burst_output_tokens, "burst", g))
    t = 0.0
    while spec.background_rps > 0:
        t += rng.expovariate(spec.background_rps)
        if t >= spec.duration_s:
            break
        n = max(1, round(rng.uniform(0.5, 1.5) * spec.background_prompt_tokens))
        out.append(Arrival(t, _ids(rng, n, spec.vocab_size), spec.background_output_tokens,
                           "background", -1))
    out.sort(key=lambda a: a.t_s)
    return out


def prefill_share(trace: list[Arrival]) -> float:
    """Prompt tokens over all tokens (prompt + output) of the trace."""
    prompt = sum(len(a.prompt_ids) for a in trace)
    total = prompt + sum(a.max_new_tokens for a in trace)
    return prompt / total if total else 0.0


def summary(trace: list[Arrival]) -> dict[str, Any]:
    bursts = [a for a in trace if a.kind == "burst"]
    return {"requests": len(trace), "burst_requests": len(bursts),
            "bursts": len({a.group for a in bursts}),
            "prompt_tokens": sum(len(a.prompt_ids) for a in trace),
            "output_tokens": sum(a.max_new_tokens for a in trace),
            "prefill_share": round(prefill_share(trace), 4),
            "last_arrival_s": round(trace[-1].t_s, 3) if trace else None}


def save_trace(trace: list[Arrival], path: str | Path) -> None:
    Path(path).write_text(json.dumps([a.as_dict() for a in trace]))


def load_trace(path: str | Path) -> list[Arrival]:
    """A trace written by `save_trace` (or by hand: t_s, prompt_ids, max_new_tokens, and
    optionally kind and group), sorted by arrival."""
    rows = json.loads(Path(path).read_text())
    out = [Arrival(float(r["t_s"]), tuple(int(i) for i in r["prompt_ids"]),
                   int(r["max_new_tokens"]), r.get("kind", "background"), int(r.get("group", -1)))
           for r in rows]
    return sorted(out, key=lambda a: a.t_s)
