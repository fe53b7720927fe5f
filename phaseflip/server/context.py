"""What every HTTP handler shares: the engine handle, the tokenizer, metrics and limits."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from phaseflip.engine.outputs import StreamDelta
from phaseflip.engine.validation import validate_request
from phaseflip.sampling.params import SamplingParams
from phaseflip.server.engine_client import EngineClient
from phaseflip.server.metrics import ServerMetrics


class OverloadedError(Exception):
    """The queue is over its bound; the client should retry later (503)."""


class UnknownModelError(Exception):
    def __init__(self, model: str, served: str) -> None:
        super().__init__(f"the model {model!r} does not exist; this server serves {served!r}")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    served_model_name: str | None = None
    """Model id clients use (default: the model directory's name)."""
    api_key: str | None = None
    """If set, requests must carry `Authorization: Bearer <key>`."""
    max_queued_requests: int = 4096
    """Requests in flight beyond which new ones get 503."""


@dataclass
class ServerContext:
    cfg: ServerConfig
    engine: EngineClient
    tokenizer: object
    model_name: str
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    started: int = field(default_factory=lambda: int(time.time()))
    # the layout a flip in progress goes to: the engine answers nothing until its seam ends,
    # so status endpoints answer from here meanwhile
    flipping_to: str | None = None

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

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The engine's own checks, done here so a bad request never crosses to the engine."""
        ready = self.engine.state.ready
        validate_request(
            prompt_ids, params, vocab_size=ready.vocab_size, max_context=ready.max_context,
            max_logprobs=ready.max_logprobs, kv_capacity_tokens=ready.kv_capacity_tokens,
            page_size=ready.page_size)
        if len(self.engine.state.in_flight) >= self.cfg.max_queued_requests:
            raise OverloadedError(
                f"the server has {len(self.engine.state.in_flight)} requests in flight "
                f"(bound {self.cfg.max_queued_requests}); retry later")

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(0, self.max_context - prompt_len)

    async def run(self, rid: str, prompt_ids: list[int],
                  params: SamplingParams) -> AsyncIterator[StreamDelta]:
        """Streams one request's deltas, recording latency metrics on the way."""
        start = last = time.perf_counter()
        first = True
        async for d in self.engine.generate(rid, prompt_ids, params):
            now = time.perf_counter()
            if d.token_ids:
                if first:
                    self.metrics.ttft.observe(now - start)
                    first = False
                else:
                    self.metrics.itl.observe((now - last) / len(d.token_ids))
                last = now
            if d.finish_reason is not None:
                self.metrics.requests.labels(d.finish_reason).inc()
            if d.usage is not None:
                self.metrics.e2e.observe(now - start)
                self.metrics.observe_usage(d.usage.prompt_tokens, d.usage.cached_tokens,
                                           d.usage.completion_tokens)
            yield d
