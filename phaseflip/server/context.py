"""What every HTTP handler shares: the engine handle, the tokenizer, metrics and limits."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from phaseflip.engine.outputs import StreamDelta
from phaseflip.engine.validation import validate_request
from phaseflip.errors import ContextLengthError, InvalidRequestError
from phaseflip.sampling.grammar_worker import GrammarProbes
from phaseflip.sampling.params import SamplingParams
from phaseflip.server.engine_client import EngineClient, EngineDeadError, ShutdownError
from phaseflip.server.metrics import ServerMetrics
from phaseflip.server.token_text import TokenText

INFO_TIMEOUT_S = 30.0  # the engine answers "info" between two steps: milliseconds, not seconds
# a /metrics scrape waits this long for the engine's figures, then renders the last ones: a
# scrape during a long step (or a paused engine) must not fail (Prometheus's timeout is 10 s)
SCRAPE_INFO_WAIT_S = 2.0


class OverloadedError(Exception):
    """The queue is over its bound; the client should retry later (503)."""


class UnknownModelError(Exception):
    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"the model {model!r} does not exist; this server serves {served!r}")


@dataclass
class RequestRecord:
    """One HTTP request as the gate follows it: the sequences it was admitted with (given
    back when its answer ends, however it ends) and its tokens, for the request log."""

    admitted: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


CURRENT_REQUEST: ContextVar[RequestRecord | None] = ContextVar("phaseflip_request", default=None)
"""The record of the HTTP request being served (set by the gate; the tasks a handler starts
inherit it)."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every IPv4 address)."""
    port: int = 8000
    """Port to listen on, 0-65535 (0: any free port, named in the ready line)."""
    served_model_name: str | None = None
    """Model id clients use (default: the model directory's name)."""
    api_key: str | None = None
    """If set, requests must carry `Authorization: Bearer <key>`. An empty key is refused (an
    unset environment variable would otherwise serve without one)."""
    max_queued_requests: int = 4096
    """Sequences in flight (prompts x n of every request) beyond which new requests get 503."""
    max_request_bytes: int = 16 * 2**20
    """Largest request body accepted, in bytes; a larger one gets 413 before it is parsed."""
    shutdown_timeout: float = 30.0
    """Seconds a SIGTERM waits for requests in flight to finish before ending them with an
    error (new requests get 503 meanwhile)."""
    metrics_without_api_key: bool = False
    """Serve /metrics without the API key (for Prometheus scrapers); /health never needs it."""
    flip_timeout_s: float = 600.0
    """Seconds POST /admin/flip waits for the seam's census before answering 504 (the seam
    goes on; further flips get 409 until the engine says it ended)."""
    responses_kept: int = 1000
    """Answers of /v1/responses kept in memory for previous_response_id and GET (the newest;
    0 keeps none)."""
    responses_kept_bytes: int = 512 * 2**20
    """Memory, in bytes, the kept /v1/responses answers may hold together (one answer can hold
    a whole context of input): beyond it the oldest are dropped, with a log line."""
    log_requests: bool = False
    """Log one line per HTTP request: its id, method and path, status, prompt and output
    tokens, and seconds taken (logger phaseflip.requests, shown at any --log-level)."""

    def __post_init__(self) -> None:
        """Refuses values that would start a server that serves wrongly instead of failing:
        --max-request-bytes -1 (every POST a 413), --api-key "" (no key at all)."""
        for name, ok, why in _SERVER_LIMITS:
            if not ok(getattr(self, name)):
                flag = "--" + name.replace("_", "-")
                raise InvalidRequestError(f"invalid server config {name}="
                                          f"{getattr(self, name)!r} ({flag}): {why}", name)


# (field, whether a value is acceptable, why not): what ServerConfig checks; NaN fails them all
_SERVER_LIMITS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("host", lambda v: bool(v.strip()), "empty; 0.0.0.0 (or ::) listens on every address"),
    ("port", lambda v: 0 <= v <= 65535, "expected 0-65535 (0: any free port)"),
    ("api_key", lambda v: v is None or bool(v.strip()),
     "an empty key (an unset environment variable?) would serve with no key at all; leave "
     "--api-key out to serve without one"),
    ("max_queued_requests", lambda v: v >= 1, "must be >= 1"),
    ("max_request_bytes", lambda v: v >= 1, "must be >= 1"),
    ("shutdown_timeout", lambda v: v >= 0,
     "must be >= 0 seconds (0 ends the requests in flight at once)"),
    ("flip_timeout_s", lambda v: v > 0, "must be > 0 seconds"),
    ("responses_kept", lambda v: v >= 0, "must be >= 0 (0 keeps none)"),
    ("responses_kept_bytes", lambda v: v >= 1, "must be >= 1 (--responses-kept 0 keeps none)"),
)


@dataclass
class ServerContext:
    cfg: ServerConfig
    engine: EngineClient
    tokenizer: object
    model_name: str
    metrics: ServerMetrics = field(init=False)
    started: int = field(default_factory=lambda: int(time.time()))
    # the target of a flip this front end asked for and the engine has not answered yet (also
    # after the caller stopped waiting: 504, a client gone); the engine's own word on seams,
    # manual or automatic, is `engine.state.flipping_to`
    flipping_to: str | None = None
    # sequences admitted by HTTP requests whose answer has not ended (the gate gives them
    # back): counted from admission on, not from the engine's first sight of the request,
    # so that concurrent requests cannot all pass the bound before any of them is running
    admitted: int = 0
    shutting_down: str | None = None  # why new work is refused, once a shutdown began
    # engine requests /abort_request asked to end, until their end comes back: counted in
    # aborted_requests_total{abort_request} then, once, if the abort ended them (one whose
    # end crossed the abort on its way ended by itself, and is not counted)
    abort_asked: set[str] = field(default_factory=set)
    # tokenising a long prompt takes seconds: off the event loop, one at a time (the fast
    # tokenizer's Rust object is not safe to share between concurrent encodes)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="phaseflip-tokenize"))

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self.model_name)

    @property
    def flip_in_progress(self) -> str | None:
        """The target of the flip under way: one asked for here and not answered, or a seam the
        engine says it is in (an automatic one, or one whose caller stopped waiting)."""
        return self.flipping_to or self.engine.state.flipping_to

    def hold_flip_guard(self, call: asyncio.Future) -> None:
        """Keeps `flipping_to` until the engine answers the flip `call` (or dies): a flip whose
        caller stopped waiting may still be queued or in its seam."""
        if call.done():
            self.flipping_to = None
        else:
            call.add_done_callback(lambda _: setattr(self, "flipping_to", None))

    async def engine_info(self, timeout_s: float | None = None) -> dict:
        """The engine's state (the "info" call), or `{"flip_in_progress": target}` while a
        flip runs: the engine answers nothing until its seam ends, so a call sent just before
        a seam began is left to its late answer, not waited for. Waits `timeout_s`
        (default INFO_TIMEOUT_S) for the answer."""
        if (target := self.flip_in_progress) is not None:
            return {"flip_in_progress": target}
        wait_s = INFO_TIMEOUT_S if timeout_s is None else timeout_s
        call = await self.engine.send_control("info")
        end = time.monotonic() + wait_s
        while not call.done():
            if (target := self.flip_in_progress) is not None:
                return {"flip_in_progress": target}
            if time.monotonic() > end:
                call.cancel()
                raise asyncio.TimeoutError(f"the engine did not answer 'info' in "
                                           f"{wait_s:g} s")
            await asyncio.wait({call}, timeout=0.05)
        return call.result().data | {"flip_in_progress": None}

    def observe_flip(self) -> None:
        """Sets the flip gauge for /metrics."""
        target, gauge = self.flip_in_progress, self.metrics.flip_in_progress
        gauge.clear()
        gauge.labels(target or "").set(1 if target else 0)

    @property
    def ready(self) -> bool:
        return self.engine.state.ready is not None and not self.engine.state.problem

    @property
    def max_context(self) -> int:
        return self.engine.state.ready.max_context

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise UnknownModelError(model, self.model_name)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def validate(self, prompt_ids: list[int], params: SamplingParams,
                 names: dict[str, str] | None = None) -> None:
        """The engine's own checks, done here so a bad request never crosses to the engine.
        `names` maps `SamplingParams` fields to the request's own (`max_new_tokens` ->
        `max_tokens`): an error names the field the client sent, in `param` and message."""
        ready = self.engine.state.ready
        try:
            validate_request(
                prompt_ids, params, vocab_size=ready.vocab_size, max_context=ready.max_context,
                max_logprobs=ready.max_logprobs, kv_capacity_tokens=ready.kv_capacity_tokens,
                page_size=ready.page_size)
        except InvalidRequestError as e:
            if not names:
                raise
            raise renamed(e, names) from None

    def check_width(self, width: int, param: str = "prompt") -> None:
        """A request of `width` sequences that no state of this server could ever admit."""
        if width > (bound := self.cfg.max_queued_requests):
            raise InvalidRequestError(
                f"this request runs {width} sequences (prompts x n); this server takes at most "
                f"{bound} at a time (--max-queued-requests)", param)

    def admit(self, params: list[SamplingParams], param: str = "prompt") -> None:
        """Counts a request's sequences (prompts x n) against --max-queued-requests; `param`
        names the request's prompt field (`/generate`: `text` or `input_ids`)."""
        bound, width = self.cfg.max_queued_requests, sum(pr.n for pr in params)
        self.check_width(width, param)
        busy = max(self.admitted, sum(self.engine.state.widths.values()))
        if busy + width > bound:
            raise OverloadedError(
                f"the server has {busy} sequences in flight and this request adds {width} "
                f"(bound {bound}); retry later")
        if (record := CURRENT_REQUEST.get()) is not None:  # (no gate: a direct call, tests)
            record.admitted += width
            self.admitted += width

    @cached_property
    def grammar_probes(self) -> GrammarProbes:
        """One child process that builds each new grammar for `check_grammar` within the
        engine's default budget (started by the first grammar; it dies with this process)."""
        return GrammarProbes(processes=1)

    @cached_property
    def token_text(self) -> TokenText:
        return TokenText(self.tokenizer)

    @cached_property
    def _max_token_chars(self) -> int:
        """The longest token's text: a prompt of c characters is at least c / this tokens.
        (Byte-level vocabularies spell a token one character per byte, and no character of
        text is less than a byte.)"""
        return max(map(len, self.tokenizer.get_vocab()), default=1) or 1

    async def in_pool(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def check_text_length(self, chars: int, what: str) -> None:
        """Refuses, without tokenising, text that cannot fit the context however it splits."""
        limit, at_least = self.max_context, -(-chars // self._max_token_chars)
        if at_least > limit:
            raise ContextLengthError(
                f"{what} has {chars} characters, so at least {at_least} tokens; this server "
                f"takes at most {limit} tokens per prompt (its context length)", what)

    async def encode(self, text: str, what: str = "prompt",
                     add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, tokenised in the pool; refused (400, stating the limit) when it
        is longer than the context."""
        self.check_text_length(len(text), what)
        ids = await self.in_pool(_encode, self.tokenizer, text, add_special_tokens)
        self.check_token_count(len(ids), what)
        return ids

    async def encode_all(self, texts: list[str], what: str) -> list[list[int]]:
        """`encode` of each, all refused before any is tokenised if one is too long."""
        names = [what] if len(texts) == 1 else [f"{what}.{i}" for i in range(len(texts))]
        for text, name in zip(texts, names):
            self.check_text_length(len(text), name)
        return [await self.encode(text, name) for text, name in zip(texts, names)]

    def check_token_count(self, n: int, what: str) -> None:
        limit = self.max_context
        if n > limit:
            raise ContextLengthError(
                f"{what} is {n} tokens, {n - limit} over this server's limit of {limit} tokens "
                f"per prompt (its context length)", what)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence (prompt + output) the engine admits: the context, or less when
        the KV pool is smaller, counted in whole pages as the admission check counts it."""
        ready = self.engine.state.ready
        pool_tokens = ready.kv_capacity_tokens // ready.page_size * ready.page_size
        return min(ready.max_context, pool_tokens)

    def default_max_tokens(self, prompt_len: int) -> int:
        """The most tokens a prompt of `prompt_len` leaves room for (0: none), the default of a
        request that does not say: capped by the KV pool too, so that a default never fails
        the engine's checks on a parameter the client did not send."""
        return max(0, self.max_sequence_tokens - prompt_len)

    def required_max_tokens(self, prompt_len: int, what: str) -> int:
        """`default_max_tokens` for a request that must answer something (chat, Responses): a
        prompt that leaves no room for one token is a 400 naming `what` (vLLM's answer), not
        an empty answer cut short by a `max_tokens` the client never set."""
        room = self.default_max_tokens(prompt_len)
        if room >= 1:
            return room
        limit, context = self.max_sequence_tokens, self.max_context
        if limit == context:
            raise ContextLengthError(
                f"This model's maximum context length is {context} tokens and the prompt is "
                f"{prompt_len}, which leaves no room for output. Shorten the prompt.", what)
        raise ContextLengthError(
            f"The KV cache pool holds {limit} tokens (the context length is {context}) and the "
            f"prompt is {prompt_len}, which leaves no room for output. Shorten the prompt, or "
            "raise max_total_tokens/mem_fraction.", what)

    async def run(self, rid: str, prompt_ids: list[int],
                  params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Streams one request's deltas, recording latency metrics on the way; a request left
        before its end (the client went away) is counted as aborted."""
        start = time.perf_counter()
        last: dict[int, float] = {}  # each sample's last token: ITL is per sample
        first, finished, cached, counted, aborted = True, set(), 0, False, False
        try:
            async for d in self.engine.generate(rid, prompt_ids, params):
                now = time.perf_counter()
                if d.index == 0 and d.cached_tokens is not None:
                    cached = d.cached_tokens
                if d.token_ids:
                    self.metrics.generation_tokens.inc(len(d.token_ids))
                    if first:
                        self.metrics.ttft.observe(now - start)
                        first = False
                    # one observation a token, as delivered: a delta of several (a stream that
                    # fell behind takes its waiting deltas as one) is one gap, then none
                    if (prev := last.get(d.index)) is not None:
                        self.metrics.itl.observe(now - prev)
                    for _ in range(len(d.token_ids) - 1):
                        self.metrics.itl.observe(0.0)
                    last[d.index] = now
                if d.finish_reason is not None:
                    self.metrics.requests.labels(d.finish_reason).inc()
                    finished.add(d.index)
                    aborted = aborted or d.finish_reason == "abort"
                if d.usage is not None:
                    self.metrics.e2e.observe(now - start)
                    self.metrics.observe_usage(d.usage.prompt_tokens, d.usage.cached_tokens)
                    counted = True
                    if (record := CURRENT_REQUEST.get()) is not None:
                        record.prompt_tokens += d.usage.prompt_tokens
                        record.completion_tokens += d.usage.completion_tokens
                yield d
        except ShutdownError:
            self.metrics.requests.labels("abort").inc(params.n - len(finished))
            self.metrics.aborted.labels("shutdown").inc()
            finished.update(range(params.n))
            raise
        except (EngineDeadError, InvalidRequestError):
            finished.update(range(params.n))  # failed, not aborted
            counted = True  # (its prompt was not processed)
            raise
        finally:
            if rid in self.abort_asked:
                self.abort_asked.discard(rid)
                if aborted:
                    self.metrics.aborted.labels("abort_request").inc()
            if len(finished) < params.n:  # the consumer left early: the client went away
                self.metrics.requests.labels("abort").inc(params.n - len(finished))
                self.metrics.aborted.labels("client_disconnect").inc()
            if not counted and not first:  # left after its prefill, before its usage came
                self.metrics.observe_usage(len(prompt_ids), cached)


def renamed(e: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """`e` with the fields in `names` called by their new names, in its message and in its
    `param` (whose first part is renamed); `e` itself when nothing is renamed."""
    message = re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b",
                     lambda m: names[m.group(1)], str(e))
    param = e.param
    head = re.match(r"\w+", param or "")
    if head is not None and head.group(0) in names:
        param = names[head.group(0)] + param[head.end():]
    if message == str(e) and param == e.param:
        return e
    return type(e)(message, param)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    # the tokenizer's __call__ (unlike `.encode` on the Rust object) releases the GIL
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
