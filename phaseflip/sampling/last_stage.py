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
alone (`sampler.seeded_noise`). A step with any other row (logprobs, a grammar, penalties or
logit bias, an active min_new_tokens ban, an unseeded random row, prompt logprobs) ships its
logits whole, as before: the whole step falls back, never part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from phaseflip.sampling.params import SamplingParams
from phaseflip.sampling.sampler import greedy, race, seeded_noise, to_device

_MASK64 = (1 << 64) - 1


@dataclass
class SampleSpec:
    """What the last stage samples, in the driver's item order. `rows`: int64 [n], the logits
    rows. Random rows (seeded): `ints` int64 [k, 4] (item index, top_k, seed as 64 bits, step
    = output length) and `floats` float64 [k, 3] (temperature, top_p, min_p); None when every
    row is greedy."""

    rows: np.ndarray
    ints: np.ndarray | None = None
    floats: np.ndarray | None = None


@dataclass
class SampledTokens:
    """A step's sampled ids (int64 [n], item order) where its logits would be: what the
    driver's `SamplingStep` takes in place of the logits."""

    tokens: torch.Tensor

    def to(self, device: torch.device) -> SampledTokens:
        return SampledTokens(self.tokens.to(device))

    def clone(self) -> SampledTokens:
        return SampledTokens(self.tokens.clone())


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
        """The spec of a scheduled batch, or None when some row needs the logits on the
        driver. `ahead`: a run-ahead step (output lengths lag by the tokens in flight: greedy
        rows only)."""
        rows: list[int] = []
        ints: list[tuple[int, int, int, int]] = []
        floats: list[tuple[float, float, float]] = []
        kind = self.kind
        for it in batch.items:
            req = it.req
            p = req.params
            k = kind(p)
            if k & _PROMPT_LP and it.num_logit_rows and req.wants_prompt_logprobs:
                return None  # read from the logits
            if not it.samples:
                continue
            if k & _MIN_NEW and len(req.output_ids) < p.min_new_tokens:
                return None  # its stop ids are banned: the driver's sampler does that
            base = k & 3
            if base == _LOGITS:
                return None
            if base == _SEEDED:
                if ahead:
                    return None
                seed = p.seed & _MASK64  # as int64 bits (step_seed masks it the same way)
                ints.append((len(rows), p.top_k, seed - (1 << 64) if seed >> 63 else seed,
                             len(req.output_ids)))
                floats.append((p.temperature, p.top_p, p.min_p))
            rows.append(it.logit_row + it.num_logit_rows - 1)
        if not ints:
            return SampleSpec(np.asarray(rows, dtype=np.int64))
        return SampleSpec(np.asarray(rows, dtype=np.int64), np.array(ints, dtype=np.int64),
                          np.array(floats, dtype=np.float64))


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
    the first maximal index for greedy rows, the seeded exponential race for random ones."""
    work = _take(logits, spec.rows).float()
    tokens = greedy(work)
    if spec.ints is None or not len(spec.ints):
        return tokens
    ints, floats = spec.ints, spec.floats
    idx = ints[:, 0].tolist()
    seeds = [s & _MASK64 for s in ints[:, 2].tolist()]
    noise = seeded_noise(seeds, ints[:, 3].tolist(), work.shape[1], work.device, work.dtype)
    at, chosen = race(work, idx, floats[:, 0].tolist(), ints[:, 1].tolist(),
                      floats[:, 1].tolist(), floats[:, 2].tolist(), noise)
    return tokens.index_copy(0, at, chosen)


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
