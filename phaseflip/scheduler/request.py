"""A request as the scheduler sees it: its tokens, its KV holdings and its progress."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from phaseflip.sampling.params import SamplingParams


@dataclass(eq=False)
class Req:
    """One generation sequence. KV holdings (`row`, `kv_len`, ...) are set only while running.

    Compared by identity (`eq=False`): two requests are never "equal", and `req in running` or
    `running.remove(req)` must not compare every field of every other request (at 512 running
    that was a field-by-field compare per list element, per removal).

    Invariants while running: table row `row` holds slots for tokens [0, alloc_len); tokens
    [0, protected_len) are owned by the prefix tree and locked through `last_node`; slots from
    `protected_len` up to the end of the page holding token alloc_len-1 belong to this request.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: tuple[int, ...]
    arrival: int
    index: int = 0  # sample index within an n > 1 group
    leader: Req | None = None  # the group member whose prompt prefill the others reuse
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # prompt_logprobs[p] is log P(prompt[p] | prompt[:p]); position 0 has none
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_lp_next: int = 0  # first position whose logits were not computed yet
    # KV holdings
    row: int | None = None
    kv_len: int = 0
    alloc_len: int = 0
    protected_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    admitted_once: bool = False
    retractions: int = 0
    # output state
    detok: Any = None
    # the sampler's view of this request (`sampling_step._inputs`), made once: its fields are
    # this request's own lists, which grow in place
    sampling_input: Any = None
    text_sent: int = 0
    text_limit: int | None = None  # output text is cut here (stop string)
    tokens_sent: int = 0
    prompt_lp_sent: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    # overlap scheduling: a token sampled on the device whose id the host does not know yet
    # (0 or 1); it is fed to the next step as a placeholder naming row `future_row` of the
    # previous step's sampled-token tensor
    pending: int = 0
    future_row: int = 0
    overlappable: bool = False  # its sampling needs nothing of the host (see EngineCore)
    # its token is to be sampled from a launched step whose logits are not sampled yet (PP
    # decode groups in flight, --pp-async-decode): nothing may schedule or re-admit it
    launched: bool = False
    # its grammar is compiling off the loop (`GrammarBook`): it waits, not admitted, until ready
    compiling: bool = False

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None:
            n = len(self.prompt_ids)
            self.prompt_logprobs = [None] * n
            self.prompt_top_logprobs = [None] * n
            self.prompt_lp_next = 0
        else:
            self.prompt_lp_next = len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """`all_ids[start:end]` without building `all_ids`: a plan needs one token per decoding
        request per step, and copying the whole context for it is O(context) each time."""
        p = len(self.prompt_ids)
        known = p + len(self.output_ids)
        if self.pending and end > known:  # a placeholder the runner resolves on the device
            return self.tokens(start, known) + [-1 - self.future_row] * min(end - known, 1)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def token(self, pos: int) -> int:
        """`tokens(pos, pos + 1)[0]` in one call: the decode row of a plan, every request every
        step (the pending token is its placeholder)."""
        p = len(self.prompt_ids)
        if pos >= p + len(self.output_ids):
            return -1 - self.future_row
        return self.output_ids[pos - p] if pos >= p else self.prompt_ids[pos]

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, a pending (sampled, not yet seen) one included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def remaining(self) -> int:
        """Tokens still to be fed to the model before the next token can be sampled."""
        # inlined num_tokens: the scheduler asks this of every running request several times
        # a step
        return len(self.prompt_ids) + len(self.output_ids) + self.pending - self.kv_len

    @property
    def remaining_output(self) -> int:
        """Output tokens it may still produce (`max_new_tokens` less those sampled)."""
        return self.params.max_new_tokens - len(self.output_ids) - self.pending

    def ends_with_pending(self, max_context: int) -> bool:
        """Its pending token will finish it by length: no step should extend it further."""
        return bool(self.pending) and (
            len(self.output_ids) + 1 >= self.params.max_new_tokens
            or self.num_tokens >= max_context)

    @property
    def prompt_only_done(self) -> bool:
        """A max_new_tokens=0 request (prompt logprobs only) whose prompt is all in."""
        return self.params.max_new_tokens == 0 and self.kv_len == self.num_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_lp_next < len(self.prompt_ids) - 1

    def private_slots(self, page_size: int) -> int:
        """Slots this request holds outside the prefix tree (whole pages)."""
        return math.ceil(self.alloc_len / page_size) * page_size - self.protected_len
