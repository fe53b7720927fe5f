"""The engine loop's last verb: sampled tokens become outputs.

`OutputProcessor` owns the request groups (the n samples of one request) and every rule that
turns a token into output: finishes (EOS, stop ids, length, stop strings, also across token
boundaries), incremental detokenisation, the text held back while it may still become a stop
string, logprobs, and the `StreamDelta`s with their usage. It never touches the device; the
scheduler learns of a finished request through `finish` (its `remove`, which returns the KV).

Tokens whose text is not needed at once (no stop strings) are queued and detokenised by
`emit_text` later, while the GPU runs the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from phaseflip.engine.outputs import StreamDelta, Usage
from phaseflip.sampling.detokenize import (
    IncrementalDetokenizer,
    find_stop_match,
    partial_stop_len,
)
from phaseflip.scheduler.request import Req

# (token id, logprob or None, top logprobs or None) of one sampled row
Sampled = tuple[int, float | None, list | None]


@dataclass
class Group:
    """The n samples of one request."""

    rid: str
    prompt_ids: list[int]
    reqs: list[Req]
    done: set[int] = field(default_factory=set)


class OutputProcessor:
    """Finish rules, text and deltas of every request group (see the module docstring)."""

    def __init__(self, tokenizer, max_context: int, finish: Callable[[Req], None],
                 stream_interval: int = 1) -> None:
        self.tokenizer, self.max_context, self.finish = tokenizer, max_context, finish
        self.stream_interval = stream_interval  # tokens a delta waits for (its first: none)
        self.groups: dict[str, Group] = {}
        self._group_of: dict[str, Group] = {}  # by sample rid ("rid#i"): no split a token
        # (request, token to detokenise or None) sampled already, text not yet made
        self.text_pending: list[tuple[Req, int | None]] = []

    def add(self, rid: str, prompt_ids: list[int], reqs: list[Req]) -> None:
        for req in reqs:
            req.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids,
                                               req.params.skip_special_tokens)
        group = self.groups[rid] = Group(rid, list(prompt_ids), reqs)
        for req in reqs:
            self._group_of[req.rid] = group

    def group(self, req: Req) -> Group:
        return self._group_of[req.rid]

    # ------------------------------------------------------------------ after a step
    def process(self, items: Iterable, sampled: dict) -> list[StreamDelta]:
        """The outputs of a synchronous step: `sampled` maps each sampling item to its
        `Sampled` row; items that did not sample may have ended their prompt-only run."""
        deltas = []
        for it in items:
            req = it.req
            if it in sampled:
                tok, lp, top = sampled[it]
                if req.params.stop:  # stop strings need the text now
                    self.append_with_text(req, tok, lp, top)
                    if not self.waits(req):
                        deltas.append(self.delta(req))
                else:
                    self.text_pending.append((req, self.append_token(req, tok, lp, top)))
            elif req.prompt_only_done:
                req.finish_reason = "length"
            if req.finished:
                self.finish(req)
                if it not in sampled:
                    deltas.append(self.delta(req))
        return deltas

    def take_tokens(self, step) -> None:
        """The sampled tokens of an overlapped step (`sampling_step.InFlight`: waits for
        them to reach the host), appended; their text is made by `emit_text`."""
        for it, tok in zip(step.items, step.host_tokens()):
            req = it.req
            req.pending = 0
            if req.finish_reason is not None:  # aborted, or finished by the token before
                continue
            self.text_pending.append((req, self.append_token(req, tok, None, None)))
            if req.finished:
                self.finish(req)

    def end(self, req: Req, reason: str) -> StreamDelta:
        """Ends `req` outside the sampled path (abort; "length" of a prompt-only run)."""
        req.finish_reason = reason
        self.finish(req)
        return self.delta(req)

    def abort(self, rid: str) -> list[StreamDelta]:
        """Ends every unfinished sample of request `rid`; its owed text goes first."""
        group = self.groups.get(rid)
        if group is None:
            return []
        out = self.emit_text(only={rid})
        if rid not in self.groups:  # its last sample's text just finished it
            return out
        return out + [self.end(req, "abort") for req in group.reqs if not req.finished]

    # ------------------------------------------------------------------ finish rules
    def append_token(self, req: Req, tok: int, lp: float | None, top) -> int | None:
        """Records a sampled token and every finish that the token alone decides (EOS, stop
        ids, length). Returns the token if its text belongs in the output, else None."""
        p = req.params
        req.output_ids.append(tok)
        if p.logprobs is not None:
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top or [])
        if (not p.ignore_eos and tok in req.eos_ids) or tok in p.stop_token_ids:
            req.finish_reason, req.matched_stop = "stop", tok
            return tok if p.include_stop_str_in_output else None
        if len(req.output_ids) >= p.max_new_tokens or req.num_tokens >= self.max_context:
            req.finish_reason = "length"
        return tok

    def append_with_text(self, req: Req, tok: int, lp: float | None, top) -> None:
        """`append_token` plus the text at once, for requests with stop strings."""
        p = req.params
        length_done = False
        text_tok = self.append_token(req, tok, lp, top)
        if req.finish_reason == "length":  # a stop string completed by this token wins
            req.finish_reason, length_done = None, True
        if req.finished:
            if text_tok is not None:
                req.detok.append([text_tok])
            return
        before = len(req.detok.text)
        req.detok.append([tok])
        if len(req.output_ids) >= p.min_new_tokens:
            match = find_stop_match(req.detok.text, p.stop, before)
            if match is not None:
                pos, stop = match
                req.finish_reason, req.matched_stop = "stop", stop
                req.text_limit = pos + (len(stop) if p.include_stop_str_in_output else 0)
                return
        if length_done:
            req.finish_reason = "length"
            req.detok.flush()

    # ------------------------------------------------------------------ text and deltas
    def emit_text(self, only: set[str] | None = None) -> list[StreamDelta]:
        """Detokenises the pending tokens (of the groups in `only`, default all) and returns
        their deltas."""
        keep, deltas = [], []
        for req, text_tok in self.text_pending:
            if only is not None and self._group_of[req.rid].rid not in only:
                keep.append((req, text_tok))
                continue
            if text_tok is not None:
                req.detok.append([text_tok])
            if req.finish_reason == "length":
                req.detok.flush()
            if not self.waits(req):
                deltas.append(self.delta(req))
        self.text_pending = keep
        return deltas

    def waits(self, req: Req) -> bool:
        """Whether `req`'s next delta waits for more tokens (`--stream-interval`): not its
        first (the time to first token) nor its last; the text and tokens it waits with come
        in the next delta, which carries everything since the last one sent."""
        return (self.stream_interval > 1 and req.finish_reason is None and req.tokens_sent > 0
                and len(req.output_ids) - req.tokens_sent < self.stream_interval)

    def delta(self, req: Req) -> StreamDelta:
        """What `req` produced since its last delta. Text that may still become a stop string
        (a suffix that is a proper prefix of one) is held back until it cannot. (Runs for
        every decoding request every step: attribute reads only where a property would do.)"""
        group = self._group_of[req.rid]
        p, finished = req.params, req.finish_reason is not None
        text = req.detok.text
        if req.text_limit is not None:
            text = text[: req.text_limit]
        end = len(text)
        if p.stop and not finished:
            end = max(req.text_sent, end - partial_stop_len(text, p.stop))
        new_text, req.text_sent = text[req.text_sent : end], end
        sent = req.tokens_sent
        req.tokens_sent = len(req.output_ids)
        lps = tops = None
        if p.logprobs is not None:
            lps, tops = req.output_logprobs[sent:], req.output_top_logprobs[sent:]
        delta = StreamDelta(group.rid, req.index, new_text, req.output_ids[sent:], lps, tops,
                            req.finish_reason, req.matched_stop)
        if sent == 0:  # known since admission: a stream can say it before the usage comes
            delta.cached_tokens = group.reqs[0].cached_tokens
        if req.index == 0 and req.prompt_logprobs is not None and not req.prompt_lp_sent and (
            not req.wants_prompt_logprobs or finished
        ):
            delta.prompt_logprobs = req.prompt_logprobs
            delta.prompt_top_logprobs = req.prompt_top_logprobs
            req.prompt_lp_sent = True
        if finished:
            group.done.add(req.index)
            if len(group.done) == len(group.reqs):
                delta.usage = Usage(
                    prompt_tokens=len(group.prompt_ids),
                    completion_tokens=sum(len(r.output_ids) for r in group.reqs),
                    cached_tokens=group.reqs[0].cached_tokens,
                )
                del self.groups[group.rid]
                for r in group.reqs:
                    del self._group_of[r.rid]
        return delta
