"""The launch warm-up: one short internal request through the engine before a server is ready.

Decode kernels compile while their CUDA graphs are captured at launch; the prefill kernels
did not, so the first client request paid for them. On the H200 the FP8 extend kernel's
compile made the first request of an 8B FP8 server take 2.29 s against 0.20 s for the next,
and at 4 req/s the eleven requests queued behind it waited 0.38-1.55 s. The warm-up runs one
request with a cached prefix (so the extend kernel runs with and without one) while the first
still decodes (a mixed step: the decode kernel's mixed-batch build), then leaves
the engine as it found it: the prefix tree emptied, the step counters restored, no flip
observer fed (a 2 s step would skew the policy's fitted step costs) and, with PP, the
prompt parts' stage times forgotten (`distributed/micro_batch.py`), for the same reason.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from phaseflip.errors import PhaseflipError
from phaseflip.sampling.params import SamplingParams

log = logging.getLogger("phaseflip.engine")

PROMPT_TOKENS = 48  # the second request's; the first has 13 fewer (an odd length)
RID = "phaseflip-warmup"
MIXED_STEPS = 2  # steps the first request runs alone (its prefill, then a decode)


def _run_requests(core: Any, prompt: list[int], n: int, params: SamplingParams) -> None:
    """The first request prefills and starts decoding; the second, which extends its cached
    prefix, arrives meanwhile, so one step mixes a decode with an extend (the decode kernel's
    mixed-batch build, `mixed_decode_attention`, compiles there too)."""
    first = dataclasses.replace(params, max_new_tokens=params.max_new_tokens + MIXED_STEPS)
    core.add_request(RID, prompt[: max(1, n - 13)], first)
    for _ in range(MIXED_STEPS):  # until the first request decodes
        if not core.has_work():
            break
        core.step()
    core.add_request(RID + "-prefix", prompt[:n], params)
    while core.has_work():
        core.step()


def warm_up(core: Any, force: bool = False) -> float | None:
    """Runs the warm-up on `core` (an idle `EngineCore`); its seconds, or None where nothing
    compiles on first use (not CUDA, unless `force`)."""
    if core.runner.device.type != "cuda" and not force:
        return None
    t0 = time.perf_counter()
    sched, observer = core.scheduler, core.flip_telemetry
    stats = dataclasses.replace(sched.stats)
    vocab = core.model_cfg.vocab_size
    n = max(2, min(PROMPT_TOKENS, core.max_context - 2))  # a model's context may be short
    prompt = [1 + (7 * i) % max(vocab - 1, 1) for i in range(n)]
    params = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    try:
        core.validate(prompt, params)
    except PhaseflipError as e:  # a pool or context too small for it: nothing to warm
        log.warning("launch warm-up skipped: %s", e)
        return None
    core.flip_telemetry = None
    try:
        _run_requests(core, prompt, n, params)
    finally:
        core.flip_telemetry = observer
    forget = getattr(core.runner, "forget_timings", None)  # PP: the parts' stage times
    if forget is not None:  # carried the compile (`micro_batch.py`)
        forget()
    if core.hicache is not None:  # in-flight copies lock tree nodes until done
        core.hicache.quiesce()
    core.kv.tree.evict_all_and_reset()
    for f in dataclasses.fields(stats):
        setattr(sched.stats, f.name, getattr(stats, f.name))
    seconds = time.perf_counter() - t0
    log.info("launch warm-up: a prefill, then an extend of its cached prefix beside its "
             "decode, in %.2f s", seconds)
    return seconds
