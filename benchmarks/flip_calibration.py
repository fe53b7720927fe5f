"""The flip workload's calibration (issue 17): an engine stepped through the trace's request
shapes in each layout of the flip pair, every step and both seams recorded, in a process of
its own; and the `--flip-seed-*` flags an auto server is seeded with from what it measured.

`benchmarks/bench_flip_workload.py` runs it before its servers (`run_calibration`), and
`flip/sim.py` fits its step models to the steps it records. It runs as a child
(`python -m benchmarks.bench_flip_workload ... --calibrate-only FILE`, in a session of its
own) because a crash there, a CUDA abort, ends the whole process: only that child dies, and
the GPU is wholly free again for the servers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from benchmarks.common import write_json
from benchmarks.flip_workload_sim import calib_rate, calib_rate_at
from phaseflip.config import parse_layout
from phaseflip.flip import workload as wl
from phaseflip.flip.policy import layout_name


class Clock(Protocol):
    """What is left of the command's wall clock (bench_flip_workload's `Budget`)."""

    def left(self) -> float: ...


# ---------------------------------------------------------------------- in-process steps
def calibrate(args: argparse.Namespace, trace: list[wl.Arrival]) -> dict[str, Any]:
    """Steps of an in-process engine in each layout of the pair over the trace's shapes, and
    both seams. Three batches a visit of a layout, queued at once: background requests (the
    decode load each seam is taken under, a few steps in, so its refill is measured too),
    then two thirds of the bursts' requests (with background), then the rest (their prefix
    cached). Visits: decode, prefill, and back to decode (its first batch only, for the
    seam); each visit's ids are its own (`_salted`), so every layout's prefill is measured
    on uncached prompts. Each layout first runs a few unrecorded requests: kernels compile
    on first use (seconds on a fresh GPU host, which would skew the fitted models)."""
    from phaseflip import Engine

    decode, prefill = (parse_layout(x) for x in args.flip_layouts.split(","))
    bursts = [a for a in trace if a.kind == "burst"][:args.calib_bursts]
    background = [a for a in trace if a.kind == "background"][:args.calib_background]
    k, b = len(background) // 3, -(-2 * len(bursts) // 3)
    batches = (background, bursts[:b] + background[:k], bursts[b:] + background[k:2 * k])
    top = max(i for a in trace for i in a.prompt_ids)
    steps: dict[str, list[dict[str, Any]]] = {}
    seams: list[tuple[Any, int]] = []
    cap = args.calib_max_new_tokens or None
    engine_args = _engine_kwargs(args.serve_args)  # the server's --model is the engine's
    with Engine(engine_args.pop("model", None), tp_size=decode[0], pp_size=decode[1],
                enable_flip=True, **engine_args) as e:
        core = e.core
        for w, layout in enumerate((prefill, decode)):  # unrecorded; ends in the decode one
            _submit(core, _warm_batch(bursts, background, w + 1), f"warm{w}", 2)
            _steps(core, {})
            core.flip(*layout)
        for j, layout in enumerate((decode, prefill, decode)):
            for i, batch in enumerate(batches[:1] if j == 2 else batches):
                _submit(core, _salted(batch, j, top), f"c{j}-{i}", cap)
                if j and not i:  # flip a few steps into the first batch: under load
                    _steps(core, steps, limit=4)
                    held = sum(r.kv_len for r in core.scheduler.running)
                    seams.append((core.flip(*layout)[0], held))
                _steps(core, steps)
    return {"steps": steps, "seams": [c.as_dict() | {"seconds": c.total_s,
                                                      "retracted_tokens": held}
                                      for c, held in seams]}


def _salted(batch: list[wl.Arrival], salt: int, top: int) -> list[wl.Arrival]:
    """The batch with every id moved by the same bijection of [1, top] (none for salt 0):
    prefixes shared within the batch stay shared, none is shared with another salt's."""
    step = salt * (top // 3 + 1)
    return batch if not salt else [
        replace(a, prompt_ids=tuple((i - 1 + step) % top + 1 for i in a.prompt_ids))
        for a in batch]


def _warm_batch(bursts: list[wl.Arrival], background: list[wl.Arrival], salt: int
                ) -> list[wl.Arrival]:
    """A burst-shaped and two background-shaped requests whose ids share no prefix with the
    trace's or another salt's (reversed, rotated by `salt`): each warm-up prefills."""
    out = []
    for a in bursts[:1] + background[:2]:
        ids = a.prompt_ids[::-1]
        out.append(replace(a, prompt_ids=ids[salt % len(ids):] + ids[:salt % len(ids)]))
    return out


def _submit(core: Any, batch: list[wl.Arrival], prefix: str, cap: int | None = None) -> None:
    from phaseflip.sampling.params import SamplingParams

    for i, a in enumerate(batch):
        n = min(a.max_new_tokens, cap) if cap else a.max_new_tokens
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        core.add_request(f"{prefix}-{i}", list(a.prompt_ids), params)


def _steps(core: Any, out: dict[str, list[dict[str, Any]]], limit: int | None = None) -> None:
    """Steps the core (to the end, or `limit` steps), recording each step that ran work
    under its layout: prompt tokens, decode rows, the decode rows' context, seconds."""
    sched, n = core.scheduler, 0
    while core.has_work() and (limit is None or n < limit):
        stats, name = sched.stats, layout_name((core.cfg.tp_size, core.cfg.pp_size))
        p0, d0 = stats.prefill_tokens, stats.decode_tokens
        ctx = sum(r.kv_len for r in sched.running if r.remaining == 1)
        t0 = time.perf_counter()
        core.step()
        dt, n = time.perf_counter() - t0, n + 1
        p, d = stats.prefill_tokens - p0, stats.decode_tokens - d0
        if p + d:
            out.setdefault(name, []).append({"prompt_tokens": p, "decode_rows": d,
                                             "ctx_tokens": ctx, "seconds": dt})


# ---------------------------------------------------------------------- its own process
def run_calibration(args: argparse.Namespace, argv: list[str], result: dict[str, Any],
                    budget: Clock) -> dict[str, Any] | None:
    """The calibration into `result` (and its JSON), in a process of its own; one that fails
    or overruns is recorded, and the runs go on without it (auto unseeded, no simulation)."""
    t0 = time.monotonic()
    try:
        calib = calibrate_isolated(argv, min(args.calib_timeout_s,
                                             budget.left() - args.reserve_s))
    except Exception as e:  # noqa: BLE001 - a one-shot GPU run keeps what else it can
        result["calibration_error"] = f"{type(e).__name__}: {e}"
        print("calibration failed:", result["calibration_error"], flush=True)
        calib = None
    else:
        result |= {"calibration": calib["steps"], "seams": calib["seams"]}
    result["timing"]["calibration_s"] = time.monotonic() - t0
    print(f"calibration: {result['timing']['calibration_s']:.1f} s", flush=True)
    write_json(args.out, result)
    return calib


def calibrate_isolated(argv: list[str], limit_s: float) -> dict[str, Any]:
    """`calibrate` in a child of its own session (`--calibrate-only`): a crash there (a CUDA
    abort ends the whole process) or an overrun ends only it and its ranks, and the GPU is
    wholly free again for the servers."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "calibration.json"
        return run_child([sys.executable, "-m", "benchmarks.bench_flip_workload", *argv,
                          "--calibrate-only", str(path)], path, limit_s)


def run_child(cmd: list[str], path: Path, limit_s: float) -> dict[str, Any]:
    """Runs `cmd` in a new session (its output to our stderr) for at most `limit_s`, then
    kills what is left of its group (ranks it spawned); returns the JSON it wrote at
    `path`. TimeoutError past the limit, RuntimeError if it failed."""
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(1.0, limit_s))
    except subprocess.TimeoutExpired:
        rc = None
    with contextlib.suppress(ProcessLookupError, PermissionError):  # none left
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if rc is None:
        raise TimeoutError(f"killed past its limit of {limit_s:.0f} s")
    if rc != 0 or not path.exists():
        raise RuntimeError(f"the calibration process exited with code {rc}")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------- the auto run's seeds
def _engine_kwargs(serve_args: str) -> dict[str, Any]:
    """The engine options `serve_args` sets, parsed by the server's own flags."""
    from phaseflip.cli import add_config_flags

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    ns, _ = parser.parse_known_args(shlex.split(serve_args))
    defaults = vars(parser.parse_args([]))
    return {k: v for k, v in vars(ns).items() if v != defaults[k]}


def prefill_step_tokens(serve_args: str) -> int:
    """The prefill step a backlog runs in on a server with these flags (the policy's S):
    min(chunk, --max-prefill-tokens), as the scheduler's budget."""
    from phaseflip.config import EngineConfig

    kw = _engine_kwargs(serve_args)
    chunk = kw.get("chunked_prefill_size", EngineConfig.chunked_prefill_size)
    most = kw.get("max_prefill_tokens", EngineConfig.max_prefill_tokens)
    return min(chunk, most) if chunk > 0 else most


def seeds(calib: dict[str, Any], decode: str, prefill: str,
          step_tokens: int | None = None) -> str:
    """--flip-seed-* flags from the calibration: the prefill rates' ratio (steps that are
    mostly prefill) and each direction's seam plus its refill, priced as the policy does.
    `step_tokens`: the server's prefill step (S), at which its policy prices X and P from a
    fitted a + b·tokens, so the ratio is taken at S too (a plain tokens ÷ seconds mixes the
    layouts' different fixed costs into it); None: plain rates."""
    def rate(name: str) -> float:
        if step_tokens is None:
            return calib_rate(calib, name)
        return calib_rate_at(calib, name, step_tokens)

    def cost(target: str) -> float:
        out = []
        for s in calib["seams"]:
            if s["target"] != target:
                continue
            load = 0.0
            if s.get("refill_bytes") and s.get("refill_rate_gbps"):
                load = min(s["refill_bytes"] / (s["refill_rate_gbps"] * 1e9), s["refill_s"])
            again = s.get("refill_tokens_prefilled") or 0
            out.append(s["seconds"] + load + (again / rate(target) if again else 0.0))
        return statistics.median(out) if out else math.nan

    flags = {"--flip-seed-pp-speedup": rate(prefill) / rate(decode),
             "--flip-seed-to-pp-s": cost(prefill), "--flip-seed-to-tp-s": cost(decode)}
    # one the calibration could not measure is left out: unmeasured, not a made-up number
    return " ".join(f"{k} {v:.4f}" for k, v in flags.items() if math.isfinite(v) and v > 0)
