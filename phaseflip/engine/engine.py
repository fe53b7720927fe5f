"""The offline Python API: `Engine(model).generate(prompts, params)` and async streaming."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import multiprocessing
import queue
import signal
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any

import torch
from tqdm.auto import tqdm

from phaseflip.config import SECTIONS, EngineConfig
from phaseflip.engine.core import EngineCore
from phaseflip.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from phaseflip.errors import InvalidRequestError
from phaseflip.model.config import ModelConfig
from phaseflip.model.loader import load_tokenizer
from phaseflip.model.resolve import resolve_model
from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.surrogates import find_lone_surrogate, lone_surrogate_problem
from phaseflip.scheduler.scheduler import longest_output_first

Prompt = str | list[int]
log = logging.getLogger(__name__)


def merge_delta(out: RequestOutput, d: StreamDelta) -> None:
    """Folds one streaming delta into an accumulating RequestOutput."""
    c = out.outputs[d.index]
    text, c.text = c.text, ""  # grown in place (see `IncrementalDetokenizer._append`)
    text += d.text
    c.text = text
    c.token_ids += d.token_ids
    if d.logprobs is not None:
        if c.logprobs is None:  # (extended in place after: a new list per delta is quadratic)
            c.logprobs = []
        if c.top_logprobs is None:
            c.top_logprobs = []
        c.logprobs += d.logprobs
        c.top_logprobs += d.top_logprobs or []
    c.finish_reason, c.matched_stop = d.finish_reason, d.matched_stop
    if d.prompt_logprobs is not None:
        out.prompt_logprobs, out.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
    if d.usage is not None:
        out.usage = d.usage


def prompt_list(prompts: Any) -> list[Prompt]:
    """`generate`'s prompts as a list: a string or a list of token ids is one prompt; any other
    iterable (a list, a tuple, a generator) holds prompts."""
    if isinstance(prompts, str) or (
            isinstance(prompts, list | tuple) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    if isinstance(prompts, bytes | dict) or not isinstance(prompts, Iterable):
        raise InvalidRequestError("prompts must be a string, a list of token ids, or an "
                                  f"iterable of either; got {type(prompts).__name__}", "prompts")
    return list(prompts)


def sampling_params(params: Any) -> SamplingParams:
    """`params` as SamplingParams: one as is, or a dict of its fields (as SGLang's engine takes
    them); InvalidRequestError names anything else, or a key that is no field."""
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, dict):
        raise InvalidRequestError("params must be a SamplingParams or a dict of its fields, "
                                  f"got {type(params).__name__}", "params")
    unknown = sorted(set(params) - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise InvalidRequestError(f"params: unknown SamplingParams field(s) {unknown}",
                                  "params")
    return SamplingParams(**params)


def params_list(params: Any, n: int) -> list[SamplingParams]:
    """`generate`'s params for its `n` prompts: None (the defaults) or one (SamplingParams or
    dict) for every prompt, or an iterable of them, one per prompt."""
    if params is None:
        return [SamplingParams()] * n
    one = isinstance(params, SamplingParams | dict | str | bytes)
    if one or not isinstance(params, Iterable):
        return [sampling_params(params)] * n  # names what it got, if it is neither
    out = [sampling_params(p) for p in params]
    if len(out) != n:
        raise InvalidRequestError(f"{n} prompts but {len(out)} params", "params")
    return out


@contextlib.contextmanager
def _interrupts_between_steps() -> Iterator[list[int]]:
    """In the main thread, a Ctrl-C (SIGINT left to Python's default handler) is held until
    the step under way ends: the list it yields is then non-empty. A step cut in half leaves
    requests that can neither be ended nor run on. A second Ctrl-C interrupts at once."""
    held: list[int] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield held
        return

    def hold(signum: int, frame: object) -> None:
        held.append(signum)
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, hold)
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """`method`, calling through a weak reference to its object (a no-op once it is gone)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _serve(ref: weakref.ref[Engine]) -> None:
    """The streaming loop (a daemon thread). It holds its engine only during a turn, so an
    engine dropped without `shutdown` is collected, and its finalizer stops the loop."""
    err: BaseException = RuntimeError("the engine was shut down")
    try:
        while (engine := ref()) is not None and not engine._stop.is_set():
            msg = None
            with engine._lock:
                idle = not engine.core.has_work()
            if idle:  # block only when idle (no spinning), holding the engine weakly
                inbox, engine = engine._inbox, None
                try:
                    msg = inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if (engine := ref()) is None:
                    return
            engine._run_once(msg)
    except BaseException as e:  # noqa: BLE001 - reported to every waiting consumer
        err = e
    engine = ref()
    if engine is not None:
        for rid in list(engine._subscribers):
            engine._publish(rid, err)


def _release(stop: threading.Event, threads: list[threading.Thread], core: EngineCore) -> bool:
    """An engine's end (`Engine.shutdown`'s, or its finalizer's): its streaming loop stopped,
    then its core closed, once. False: the loop did not stop, the core is left open (closed
    under a step that runs on, it could crash the process)."""
    stop.set()
    others = [t for t in threads if t is not threading.current_thread()]
    for t in others:
        t.join(timeout=5)
    if any(t.is_alive() for t in others):
        log.warning("the engine's loop did not stop within 5 s")
        return False
    threads.clear()
    core.close()
    return True


def _refuse_while_bootstrapping() -> None:
    """A script that makes an engine at import time makes one in every rank too: the ranks'
    forkserver (like spawn) imports the script's main module again before the rank runs. That
    engine would load the model and start ranks of its own; the user saw only "the rank group
    did not form". (`_inheriting` is multiprocessing's own flag for that import.)"""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "phaseflip.Engine was created while a new process was starting: the script's main "
            "module is imported again in each rank process, so the code that makes the "
            "Engine must sit under `if __name__ == \"__main__\":`")


class Engine:
    """An inference engine for one model in this process.

    `generate` runs the loop in the calling thread; the async API runs it in a background
    thread that sleeps when there is no work. Use as a context manager to free the model.
    """

    def __init__(self, model: str | None = None, **config: Any) -> None:
        _refuse_while_bootstrapping()
        known = {*EngineConfig.field_names(), *SECTIONS}
        unknown = sorted(set(config) - known)
        if unknown:
            raise InvalidRequestError(f"unknown engine options {unknown}; known: {sorted(known)}")
        if model is not None:
            config["model"] = str(model)
        self.config = resolve_model(EngineConfig(**config))
        self.model_config = ModelConfig.from_dir(self.config.model)
        self.tokenizer = load_tokenizer(self.config.model)
        self.core = EngineCore(self.config, self.model_config, self.tokenizer)
        # a stream whose grammar failed to compile (off the loop) raises its error; an
        # offline `generate` request ends "abort" (its grammar was built when it was validated).
        # Held weakly: an engine<->core cycle would keep a dropped engine, and its device
        # memory, for good once the heap is frozen (`heap.freeze_heap`).
        self.core.request_failed = _weakly(self._publish)
        self._ids = itertools.count()
        self._lock = threading.Lock()  # serialises core access between the two drivers
        self._inbox: queue.Queue = queue.Queue()
        self._threads: list[threading.Thread] = []  # the streaming loop's, while it runs
        self._stop = threading.Event()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # `shutdown`, else the engine's collection or the interpreter's exit (where a loop
        # still stepping in its daemon thread aborts the process: "terminate called ...")
        self._finalizer = weakref.finalize(self, _release, self._stop, self._threads, self.core)

    # ------------------------------------------------------------------ helpers
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", param="prompt")
            bad = find_lone_surrogate(prompt)  # (what a tokenizer cannot encode: a TypeError)
            if bad is not None:
                raise InvalidRequestError(
                    f"the prompt {lone_surrogate_problem(prompt, bad)}", "prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list | tuple):
            raise InvalidRequestError("a prompt is a string or a list of token ids", "prompt")
        return list(prompt)

    def _new_output(self, rid: str, ids: list[int], n: int) -> RequestOutput:
        return RequestOutput(rid, ids, [CompletionOutput(index=i) for i in range(n)])

    def _live_core(self) -> EngineCore:
        """The core; a clear error once `shutdown` has freed it (not an AttributeError)."""
        if self.core is None:
            raise RuntimeError("the engine is shut down: build a new Engine to generate again")
        return self.core

    # ------------------------------------------------------------------ offline
    def generate(
        self,
        prompts: Prompt | Iterable[Prompt],
        params: SamplingParams | dict | Sequence[SamplingParams | dict] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates for every prompt (a string, token ids, or an iterable of either); returns
        one RequestOutput per prompt, in order. `params`: one for every prompt or one per
        prompt, each a SamplingParams or a dict of its fields. Invalid input raises before
        anything runs."""
        core = self._live_core()
        prompts = prompt_list(prompts)
        params = params_list(params, len(prompts))
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, params):
            core.validate(ids, p)
        with self._lock:
            results: dict[str, RequestOutput] = {}
            order = [f"gen-{next(self._ids)}" for _ in encoded]
            bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm, unit="req")
            in_step = False
            try:
                with _interrupts_between_steps() as interrupted:
                    # the call returns with its last request: the longest outputs go in first
                    for i in longest_output_first([p.max_new_tokens for p in params]):
                        core.add_request(order[i], encoded[i], params[i])
                        results[order[i]] = self._new_output(order[i], encoded[i], params[i].n)
                    pending = set(order)
                    while pending and not interrupted:
                        in_step = True
                        deltas = core.step()
                        in_step = False
                        for d in deltas:
                            out = results.get(d.request_id)
                            if out is None:  # a streaming request: hand it to its consumer
                                self._publish(d.request_id, d)
                                continue
                            merge_delta(out, d)
                            if d.usage is not None:
                                pending.discard(d.request_id)
                                bar.update(1)
                    if interrupted:
                        raise KeyboardInterrupt
            except BaseException:
                # Ctrl-C or an error between steps: none of this call's requests may stay in
                # the engine, holding KV and the steps of the calls after it. (Cut inside a
                # step, they cannot be ended: they run on, their outputs dropped.)
                if not in_step:
                    for rid in order:
                        core.abort(rid)
                raise
            finally:
                bar.close()
        return [results[r] for r in order]

    # ------------------------------------------------------------------ streaming
    async def generate_stream(
        self, prompt: Prompt, params: SamplingParams | dict | None = None,
        request_id: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Yields deltas as tokens are produced; the last delta of each sample carries its
        finish reason. Cancelling the consumer aborts the request and frees its KV."""
        core = self._live_core()
        params = SamplingParams() if params is None else sampling_params(params)
        ids = self.encode(prompt)
        core.validate(ids, params)
        rid = request_id or f"stream-{next(self._ids)}"
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._subscribers or rid in core.groups:
                raise InvalidRequestError(f"request id {rid!r} is already in use", "request_id")
            self._subscribers[rid] = (asyncio.get_running_loop(), q)
        self._ensure_thread()
        self._inbox.put(("add", rid, ids, params))
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.usage is not None
                yield item
        finally:
            self._subscribers.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))

    def _ensure_thread(self) -> None:
        self._threads[:] = [t for t in self._threads if t.is_alive()]
        if not self._threads:
            self._stop.clear()
            thread = threading.Thread(target=_serve, args=(weakref.ref(self),),
                                      name="phaseflip-engine", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run_once(self, msg: tuple | None) -> None:
        """One turn of the streaming loop: the inbox's messages (`msg` first), then a step."""
        with self._lock:
            if msg is None:
                msg = self._next_message()
            while msg is not None:
                self._handle(msg)
                msg = self._next_message()
            deltas = self.core.step(sink=self._publish_all) if self.core.has_work() else []
        self._publish_all(deltas)

    def _next_message(self) -> tuple | None:
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "add":
            _, rid, ids, params = msg
            try:
                self.core.add_request(rid, ids, params)
            except Exception as e:  # reported to the waiting consumer, loop keeps running
                self._publish(rid, e)
        elif msg[0] == "abort":
            self.core.abort(msg[1])

    def _publish_all(self, deltas: list[StreamDelta]) -> None:
        for d in deltas:
            self._publish(d.request_id, d)

    def _publish(self, rid: str, item: StreamDelta | Exception) -> None:
        sub = self._subscribers.get(rid)
        if sub is not None:
            loop, q = sub
            try:
                loop.call_soon_threadsafe(q.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed
                self._subscribers.pop(rid, None)

    # ------------------------------------------------------------------ phase flip
    def flip(self, tp_size: int, pp_size: int):
        """Re-lays the engine out as tp_size × pp_size between two steps; running requests
        are retracted and re-admitted (see `phaseflip.engine.flip`). Returns the seam census."""
        core = self._live_core()
        with self._lock:
            census, _ = core.flip(tp_size, pp_size, sink=self._publish_all)
        return census

    # ------------------------------------------------------------------ lifetime
    def pool_accounting(self):
        core = self._live_core()
        with self._lock:
            return core.kv.check(core.scheduler.running)

    def shutdown(self) -> None:
        """Stops the loop and gives back everything the engine took: rank processes, weights,
        KV pool, graphs, workspaces and host tiers are freed (`EngineCore.close`), what
        still refers to them is dropped, and the device's cached blocks go back to the
        driver, so another engine in this process has the whole device again. An engine
        dropped or still open at the interpreter's exit is closed the same way."""
        core = self.core
        if self._finalizer() is False and core is not None:
            core.close()  # asked for: the ranks go even under a step that does not end
        self.core = None  # the last reference to the loop's objects (sampler, backend...)
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
