"""Typed messages between the HTTP front end and the engine process, and their one codec.

Every message is a small dataclass; `encode`/`decode` turn any of them into bytes. Decoding
only ever constructs the classes registered here (plus plain containers), so a stray or
malicious frame cannot instantiate arbitrary objects.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any

from phaseflip.engine.outputs import StreamDelta, Usage
from phaseflip.sampling.grammar import GrammarSpec
from phaseflip.sampling.params import SamplingParams

# ---------------------------------------------------------------- front end → engine


@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Control:
    """A call that expects a `ControlReply` with the same `call_id`."""

    call_id: int
    op: str  # "info", "flush_cache", "flip", "shutdown"
    args: dict | None = None  # the op's arguments ("flip": tp_size, pp_size)


# ---------------------------------------------------------------- engine → front end


@dataclass
class Ready:
    model: str
    max_context: int
    vocab_size: int
    kv_capacity_tokens: int
    device: str
    dtype: str
    page_size: int = 1
    max_logprobs: int = 20


@dataclass
class Deltas:
    deltas: list[StreamDelta]
    running: int = 0
    waiting: int = 0

    def __reduce__(self) -> tuple:
        """Pickled as each delta's field tuple (`StreamDelta.as_tuple`): the front end
        unpickled a step of 256 one-token deltas at ~3.7 us a delta as dataclass instances,
        ~0.5 us as tuples rebuilt by `_deltas` (and the engine pickles them faster too)."""
        return (_deltas, (self.running, self.waiting, [d.as_tuple() for d in self.deltas]))


def _deltas(running: int, waiting: int, rows: list[tuple]) -> Deltas:
    return Deltas([StreamDelta(*r) for r in rows], running, waiting)


@dataclass
class RequestFailed:
    rid: str
    kind: str  # "invalid_request_error" or "server_error"
    message: str
    param: str | None = None
    # admitted before it failed (a grammar that failed off the loop): its abort deltas, the
    # last with usage, still follow, and its id stays taken until they have come
    ends_later: bool = False


@dataclass
class EngineHealth:
    """The engine's own view of its health, sent when it changes: unhealthy (a stall, a dead
    rank) before it exits, so /health answers 503 with `reason` and new requests are refused
    at once; healthy again (e.g. a stall that resolved) lifts that."""

    healthy: bool
    reason: str = ""


@dataclass
class FlipState:
    """A phase-flip seam started (`flipping_to` names its target, e.g. "tp1×pp2") or ended
    (None), manual or automatic. The engine answers nothing while in a seam, so the front end
    holds its flip guard and answers status calls itself for as long as the engine says one
    runs, whether or not anyone still waits for the flip's answer."""

    flipping_to: str | None


@dataclass
class ControlReply:
    call_id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    param: str | None = None  # the field a refusal names (the HTTP error's `param`)


Message = (AddRequest | AbortRequest | Control | Ready | Deltas | RequestFailed | ControlReply
           | EngineHealth | FlipState)

_ALLOWED = {
    (c.__module__, c.__name__)
    for c in (AddRequest, AbortRequest, Control, Ready, Deltas, RequestFailed, ControlReply,
              EngineHealth, FlipState, StreamDelta, Usage, SamplingParams,
              GrammarSpec, _deltas)
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"message codec refuses {module}.{name}")


def encode(msg: Message) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Message:
    return _Unpickler(io.BytesIO(data)).load()
