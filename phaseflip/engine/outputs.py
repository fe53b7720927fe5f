"""What generation returns: whole results (offline) and per-step deltas (streaming)."""

from __future__ import annotations

from dataclasses import dataclass, field

TopLogprobs = list[tuple[int, float]]
_NO_OPTIONALS = (None,) * 8  # a StreamDelta's optional fields, all unset


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length" or "abort"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[float | None] | None = None  # entry 0 is None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids


@dataclass
class StreamDelta:
    """New output of one sample of one request since the previous delta."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: list[float | None] | None = None  # once, when computed, if asked
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    usage: Usage | None = None  # on the request's last delta
    cached_tokens: int | None = None  # on each sample's first delta: the prefix cache's share

    def as_tuple(self) -> tuple:
        """The fields in order, the eight optional ones left off when all are None (the
        usual delta): `StreamDelta(*t)` rebuilds it. The wire form of a step's deltas
        (`server.messages.Deltas`): a tuple pickles and unpickles in a fraction of the time
        a dataclass instance's state dict does."""
        head = (self.request_id, self.index, self.text, self.token_ids)
        rest = (self.logprobs, self.top_logprobs, self.finish_reason, self.matched_stop,
                self.prompt_logprobs, self.prompt_top_logprobs, self.usage, self.cached_tokens)
        return head if rest == _NO_OPTIONALS else head + rest

    def joins(self, later: StreamDelta) -> bool:
        """Whether `later` may follow this delta into one (`joined`): the same sample, and
        this one not its last."""
        return (later.request_id == self.request_id and later.index == self.index
                and self.finish_reason is None and self.usage is None)

    @staticmethod
    def joined(parts: list[StreamDelta]) -> StreamDelta:
        """Consecutive deltas of one sample (each `joins` the next) as one: what a consumer
        that fell behind sends as one chunk instead of several (the same text, tokens and
        logprobs; the last one's end). Built once, linear in what they hold."""
        first, last = parts[0], parts[-1]

        def cat(name: str) -> list | None:
            lists = [v for d in parts if (v := getattr(d, name)) is not None]
            return None if not lists else [x for v in lists for x in v]

        def once(name: str) -> object:  # (sent with one delta of the sample at most)
            return next((v for d in parts if (v := getattr(d, name)) is not None), None)

        return StreamDelta(
            first.request_id, first.index, "".join(d.text for d in parts),
            [t for d in parts for t in d.token_ids], cat("logprobs"), cat("top_logprobs"),
            last.finish_reason, last.matched_stop, once("prompt_logprobs"),
            once("prompt_top_logprobs"), last.usage, once("cached_tokens"))
