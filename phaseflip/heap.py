"""The host heap: keeping the cyclic collector off the step loop and out of CUDA-graph
captures, and giving freed pages back to the OS."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from collections.abc import Iterator

# While the heap is frozen: young-generation passes between full passes (Python's default: 10)
FROZEN_FULL_PASS_EVERY = 1000
PYTHON_FULL_PASS_EVERY = 10


def release_freed_heap() -> None:
    """Gives the heap pages freed by a retired layout back to the OS. glibc keeps them: the
    engine's RSS grew with every flip (417 -> 463 MiB over the 29 flips of a 10-minute soak,
    ~1.3 MiB a flip, steadily), none of it live objects, all of it returned by a trim; worker
    ranks grew 0.5-1 MiB a flip the same way. A no-op off glibc."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def freeze_heap() -> None:
    """Moves every object alive now out of the cyclic collector's reach (`gc.freeze`), so its
    oldest-generation passes walk only what was made since. Unfrozen, each pass walked the
    whole import heap (torch, transformers, triton: ~290 000 objects) on the step loop's
    thread: 235-320 ms each, two or three per FP8 offline run of 1 000 requests on the H200
    (1.1 s of 18.9 s), the GPU idle meanwhile. Call once a process's engine or rank is built;
    `thaw_heap` at its end, so that what it leaves in reference cycles can be collected.

    Frozen, a full pass still walks what the run made since: ~26 ms at a thousand live
    requests, six times a run, each a host stall the GPU drained its queue behind (FP8
    offline, 1 000 requests, H200: 2 % of the run; with the collector off, the same). So full
    passes also come 100 times rarer while frozen; the young passes, which free almost all
    the step loop's garbage, run as before."""
    gc.collect()
    gc.freeze()
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, max(full, FROZEN_FULL_PASS_EVERY))


def thaw_heap() -> None:
    """Undoes `freeze_heap` (the frozen objects become collectable again). Process-wide, like
    the freeze: closing one engine thaws what another engine of the process froze too, which
    costs that one its shorter passes, never an object. Full passes return to Python's pace."""
    gc.unfreeze()
    young, middle, full = gc.get_threshold()
    if full == FROZEN_FULL_PASS_EVERY:  # ours: another setting is left as it is
        gc.set_threshold(young, middle, PYTHON_FULL_PASS_EVERY)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic-collector pass inside (it runs later, when allocations next trigger one). For
    CUDA-graph captures: a pass may free an older CUDA graph left in a reference cycle (a
    closed engine's, a retired layout's), and destroying a graph while this thread captures
    another invalidates the capture. Seen on the H200: a decode-graph capture failed with
    "operation failed due to a previous error during capture" after four "operation not
    permitted when stream is capturing (function reset)" warnings, in a test process where
    earlier engines had run (`tests/test_gpu.py` then `tests/test_cuda_graph.py`)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def freeze_for_exit() -> None:
    """At a process's very end, once its work is done: every object out of the collector's
    reach, so the interpreter's own passes as it finalises walk nothing. Each of those walked
    the whole import heap (torch, transformers, FastAPI: ~330 000 objects), 0.7-0.9 s of a
    2-core box per process, which a stopping server paid twice (front end, engine) and
    `generate` once. What stays in reference cycles is then never collected: the OS takes the
    memory back. `weakref.finalize` callbacks and atexit hooks still run."""
    gc.freeze()
