"""Sampling on the last pipeline stage: token ids cross ranks, not logits.

With PP the logits are made on the last stage's TP rank 0, another process than the driver.
Shipping them costs rows x vocab float32 a step (256 x 128k: 128 MiB, over NCCL or a
shared-memory pipe) and the driver's reduction over them; vLLM and SGLang sample on the last
PP rank and send the ids. Here the driver still decides everything (law 1): it says, per step,
which logits rows to sample and with which parameters (`SampleSpec`, in the step message),
and the last stage runs the same functions the driver's `Sampler` would on the same rows, so
the tokens equal one process's bit for bit.

Only rows whose choice is a function of the logits and of what the plan carries qualify:
greedy rows, and (synchronous steps) seeded random rows, whose draw depends on (seed, step)
alone (`sampler.seeded_noise`; on CUDA the fused race keyed by `step_seed(seed, step)`, as
the driver's). The other rows (logprobs, a grammar, penalties or logit bias, an active
min_new_tokens ban, an unseeded random row, prompt logprobs) are the driver's: a mixed step
sends the ids of the last stage's rows and the logits of the driver's rows only
(`SampleSpec.ship`), in one message. A step with none of the last stage's rows ships its
logits as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import (
    choose_tokens,
    greedy,
    seeded_noise,
    step_seed,
    to_device,
)

_MASK64 = (1 << 64) - 1


@dataclass
class SampleSpec:
    """What the last stage samples, in the driver's item order. `rows`: int64 [n], the logits
    rows. Random rows (seeded): `ints` int64 [k, 4] (index into `rows`, top_k, seed as 64
    bits, step = output length) and `floats` float64 [k, 3] (temperature, top_p, min_p);
    None when every row is greedy. `ship`: int64 [m], ascending, the logits rows sent back
    too (the driver's rows: its sampling items' and prompt logprobs'), or None. `local`
    (rank 0 only, not on the wire): the positions, among the step's sampling items, of
    those the driver samples."""

    rows: np.ndarray
    ints: np.ndarray | None = None
    floats: np.ndarray | None = None
    ship: np.ndarray | None = None
    local: list[int] | None = None

    def message(self, vocab: int) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape and dtype of the last stage's message: the ids, or (with `ship`) the
        ids' bytes then the shipped logits' (float32), as one byte tensor."""
        n = len(self.rows)
        if self.ship is None:
            return (n,), torch.int64
        return (8 * n + 4 * len(self.ship) * vocab,), torch.uint8


@dataclass
class SampledTokens:
    """A step's sampled ids (int64 [n], the spec's rows) where its logits would be: what the
    driver's `SamplingStep` takes in place of the logits; with a mixed step, also the logits
    of the driver's rows (`logits` [m, V], the spec's `ship` rows)."""

    tokens: torch.Tensor
    spec: SampleSpec | None = None
    logits: torch.Tensor | None = None

    @staticmethod
    def unpack(t: torch.Tensor, spec: SampleSpec, vocab: int, copy: bool) -> SampledTokens:
        """From the last stage's message `t` (`SampleSpec.message`); `copy`: the ids get a
        buffer of their own (they become the next run-ahead step's tokens)."""
        if spec.ship is None:
            return SampledTokens(t.clone() if copy else t, spec)
        n = 8 * len(spec.rows)
        ids = t[:n].view(torch.int64)
        return SampledTokens(ids.clone() if copy else ids, spec,
                             t[n:].view(torch.float32).view(len(spec.ship), vocab))

    def to(self, device: torch.device) -> SampledTokens:
        logits = None if self.logits is None else self.logits.to(device)
        return SampledTokens(self.tokens.to(device), self.spec, logits)

    def clone(self) -> SampledTokens:
        logits = None if self.logits is None else self.logits.clone()
        return SampledTokens(self.tokens.clone(), self.spec, logits)

    @property
    def local(self) -> list[int]:
        """Positions of the sampling items the driver samples (from `logits`)."""
        return (self.spec.local or []) if self.spec is not None else []

    def rows(self, first: list[int]) -> torch.Tensor:
        """`logits` at the logits rows `first` (each one of the spec's `ship`)."""
        at = np.searchsorted(self.spec.ship, np.asarray(first, dtype=np.int64))
        return _take(self.logits, at)

    def block(self, first: int, n: int) -> torch.Tensor:
        """`logits` at the logits rows [first, first + n) (shipped whole, in order)."""
        at = int(np.searchsorted(self.spec.ship, first))
        return self.logits[at : at + n]


# a params object's verdict (`SpecBuilder.kind`): its base in the low bits, then flags for
# what depends on the request's progress
_LOGITS, _GREEDY, _SEEDED = 0, 1, 2
_MIN_NEW, _PROMPT_LP = 4, 8


def _kind(p: SamplingParams) -> int:
    if p.logprobs is not None or p.grammar is not None or p.has_penalties:
        base = _LOGITS
    elif p.is_greedy:
        base = _GREEDY
    else:
        base = _LOGITS if p.seed is None else _SEEDED
    return (base | (_MIN_NEW if p.min_new_tokens else 0)
            | (_PROMPT_LP if p.prompt_logprobs is not None else 0))


class SpecBuilder:
    """Builds the driver's `SampleSpec`s, remembering each params object's verdict (the
    checks per row cost ~90 us a step at batch 256; `SamplingParams` are treated as
    immutable). Held by the engine's `SamplingStep`: no module state."""

    LIMIT = 8192  # params objects remembered at most (then forgotten all at once)

    def __init__(self) -> None:
        self._kinds: dict[int, tuple[SamplingParams, int]] = {}

    def kind(self, p: SamplingParams) -> int:
        got = self._kinds.get(id(p))
        if got is not None and got[0] is p:  # the object itself held: its id is not reused
            return got[1]
        if len(self._kinds) >= self.LIMIT:
            self._kinds.clear()
        k = _kind(p)
        self._kinds[id(p)] = (p, k)
        return k

    def spec(self, batch, ahead: bool) -> SampleSpec | None:
        """The spec of a scheduled batch, or None when the last stage has no row of it to
        sample (then the logits come whole). `ahead`: a run-ahead step (output lengths lag by
        the tokens in flight: its seeded rows are the driver's)."""
        rows: list[int] = []
        ints: list[tuple[int, int, int, int]] = []
        floats: list[tuple[float, float, float]] = []
        ship: list[int] = []
        local: list[int] = []
        kind, pos = self.kind, 0
        for it in batch.items:
            req = it.req
            p = req.params
            k = kind(p)
            if k == _GREEDY:  # most rows: no flag to check
                if it.samples:
                    rows.append(it.logit_row + it.num_logit_rows - 1)
                    pos += 1
                continue
            lp = bool(k & _PROMPT_LP and it.num_logit_rows and req.wants_prompt_logprobs)
            if lp:  # read from the logits: every row of it goes to the driver
                ship.extend(range(it.logit_row, it.logit_row + it.num_logit_rows))
            if not it.samples:
                continue
            row, base = it.logit_row + it.num_logit_rows - 1, k & 3
            if (lp or base == _LOGITS or (base == _SEEDED and ahead)
                    or (k & _MIN_NEW and len(req.output_ids) < p.min_new_tokens)):
                local.append(pos)  # the driver's (a min_new_tokens ban: its sampler's)
                if not lp:
                    ship.append(row)
            else:
                if base == _SEEDED:
                    seed = p.seed & _MASK64  # as int64 bits (step_seed masks it the same)
                    ints.append((len(rows), p.top_k, seed - (1 << 64) if seed >> 63 else seed,
                                 len(req.output_ids)))
                    floats.append((p.temperature, p.top_p, p.min_p))
                rows.append(row)
            pos += 1
        if not rows:
            return None
        spec = SampleSpec(np.asarray(rows, dtype=np.int64))
        if ints:
            spec.ints = np.array(ints, dtype=np.int64)
            spec.floats = np.array(floats, dtype=np.float64)
        if ship:
            spec.ship, spec.local = np.asarray(ship, dtype=np.int64), local
        return spec


def spec_for(batch, ahead: bool) -> SampleSpec | None:
    """`SpecBuilder.spec` without a memory (tests)."""
    return SpecBuilder().spec(batch, ahead)


def _take(logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """`logits[rows]`: a view when the rows are consecutive (every decode step)."""
    n = len(rows)
    if n == 0:
        return logits[:0]
    if int(rows[-1]) - int(rows[0]) == n - 1 and bool((np.diff(rows) == 1).all()):
        return logits[int(rows[0]) : int(rows[0]) + n]
    return logits[to_device(rows.tolist(), torch.long, logits.device)]  # no stream sync


def sample_rows(logits: torch.Tensor, spec: SampleSpec) -> torch.Tensor:
    """The ids the driver's `Sampler` would choose for `spec`'s rows of `logits` (float32):
    the first maximal index for greedy rows, the seeded exponential race for random ones,
    through the driver's `choose_tokens` (on CUDA the fused race, with the same seeds)."""
    work = _take(logits, spec.rows).float()
    if spec.ints is None or not len(spec.ints):
        return greedy(work)
    ints, floats = spec.ints, spec.floats
    idx = ints[:, 0].tolist()
    seeds = [s & _MASK64 for s in ints[:, 2].tolist()]
    steps = ints[:, 3].tolist()
    vocab, device = work.shape[1], work.device

    def row_seeds(plain: list[int]) -> torch.Tensor:
        host = [0] * len(spec.rows)
        for j in plain:
            host[idx[j]] = step_seed(seeds[j], steps[j])
        return to_device(host, torch.int64, device)

    def noise(raced: list[int]) -> torch.Tensor:
        return seeded_noise([seeds[j] for j in raced], [steps[j] for j in raced], vocab,
                            device, torch.float32)

    return choose_tokens(work, idx, floats[:, 0].tolist(), ints[:, 1].tolist(),
                         floats[:, 1].tolist(), floats[:, 2].tolist(), row_seeds, noise)


def pack(parts: list[torch.Tensor], spec: SampleSpec) -> tuple[list[torch.Tensor], int]:
    """The last stage's message from its micro-batches' logits (`SampleSpec.message`), as
    parts to send back to back, and the logits bytes in it."""
    if spec.ship is None:
        return [sample_parts(parts, spec)], 0
    logits = parts[0] if len(parts) == 1 else torch.cat(parts)
    ids = sample_rows(logits, spec)
    shipped = _take(logits, spec.ship).float().contiguous()
    return ([ids.view(torch.uint8), shipped.view(-1).view(torch.uint8)],
            4 * shipped.numel())


def sample_parts(parts: list[torch.Tensor], spec: SampleSpec) -> torch.Tensor:
    """`sample_rows` over the micro-batches' logits, rows after rows. Greedy rows in order
    are reduced part by part (a greedy row depends on its own logits only): the parts are
    not concatenated first (256 rows of a large vocabulary: a copy the size of the logits)."""
    rows = spec.rows
    ordered = len(rows) < 2 or bool((np.diff(rows) > 0).all())
    if len(parts) == 1 or spec.ints is not None or not ordered:
        return sample_rows(parts[0] if len(parts) == 1 else torch.cat(parts), spec)
    out, off = [], 0
    for part in parts:
        n = part.shape[0]
        a, b = np.searchsorted(rows, (off, off + n)).tolist()
        if b > a:
            out.append(greedy(_take(part, rows[a:b] - off).float()))
        off += n
    if not out:
        return torch.empty(0, dtype=torch.int64, device=parts[0].device)
    return torch.cat(out) if len(out) > 1 else out[0]
